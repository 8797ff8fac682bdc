"""The thread the forward runs on under asynchronous scheduling.

glibc gives each new thread a malloc arena of its own, and a thread arena returns freed
memory to the system far more eagerly than the main heap: the forward's large temporaries
then fault fresh pages in every step. Measured on the embedded model, that made the same
forward 20-25% slower on a worker thread than on the main thread in batch-invariant mode.
Capping glibc at one arena before the thread first allocates makes it share the main heap,
and the difference disappears.
"""

import ctypes
import ctypes.util
from concurrent.futures import ThreadPoolExecutor

# mallopt parameter number of M_ARENA_MAX in glibc's malloc.h.
_M_ARENA_MAX = -8


def start_compute_thread() -> ThreadPoolExecutor:
    """A single-thread executor, started now, whose thread allocates from the main heap."""
    _share_main_heap()
    executor = ThreadPoolExecutor(1, "deepwell-forward")
    executor.submit(bytearray, 1 << 20).result()  # start the thread; it takes its arena now
    return executor


def _share_main_heap() -> None:
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "mallopt"):  # glibc; other C libraries manage threads differently
        libc.mallopt(_M_ARENA_MAX, 1)
