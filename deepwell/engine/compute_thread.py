"""The thread the forward runs on under asynchronous scheduling.

glibc gives each new thread a malloc arena of its own, and a thread arena returns freed
memory to the system far more eagerly than the main heap: the forward's large temporaries
then fault fresh pages in every step. Measured on the embedded model, that made the same
forward 20-25% slower on a worker thread than on the main thread in batch-invariant mode.
Capping glibc at one arena before the thread first allocates makes it share the main heap,
and the difference disappears.

With more than one torch thread the starting thread hands its cores to the compute thread.
libgomp keeps a pool of worker threads for every thread that has run a parallel region, and
once its pools hold more threads than the process has CPUs it spins only ~100 rounds
between regions before sleeping (`gomp_throttled_spin_count_var`): every small parallel op
of the forward then waits for a futex wake-up. Two torch threads on two cores got there as
soon as the step loop's thread had run one parallel op (model loading does), and the
overlapped loop lost to the synchronous one (docs/benchmarks-log.md, "W's wall time at two
threads"). So the starting thread frees its pool (`omp_pause_resource_all`) and runs its own
ops on one thread while the compute thread lives; the compute thread's team alone spins.
"""

import ctypes
import ctypes.util
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

# mallopt parameter number of M_ARENA_MAX in glibc's malloc.h.
_M_ARENA_MAX = -8
# omp_pause_soft in omp.h: free the thread pool, keep what a later region needs to restart.
_OMP_PAUSE_SOFT = 1


class ComputeThread(ThreadPoolExecutor):
    """A single-thread executor whose thread allocates from the main heap and, with more than
    one torch thread, runs the process's only spinning OpenMP team."""

    def __init__(self) -> None:
        _share_main_heap()
        super().__init__(1, "deepwell-forward")
        self.submit(bytearray, 1 << 20).result()  # start the thread; it takes its arena now
        self._owner = threading.get_ident()
        # The starting thread's torch threads before it handed its cores over; None: kept.
        self.owner_threads = _hand_cores_over()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait, cancel_futures=cancel_futures)
        # An OpenMP thread count belongs to the thread that set it: only the owner can restore.
        if self.owner_threads is not None and threading.get_ident() == self._owner:
            _libgomp().omp_set_num_threads(self.owner_threads)
            self.owner_threads = None


def start_compute_thread() -> ComputeThread:
    """The compute thread, started now."""
    return ComputeThread()


def _hand_cores_over() -> int | None:
    """Free this thread's libgomp pool and run its own ops on one thread; its former torch
    thread count, or None where there was nothing to hand over or no libgomp to ask."""
    threads = torch.get_num_threads()
    gomp = _libgomp() if threads > 1 else None
    if gomp is None or not hasattr(gomp, "omp_pause_resource_all"):
        return None
    if gomp.omp_pause_resource_all(_OMP_PAUSE_SOFT) != 0:
        return None
    gomp.omp_set_num_threads(1)
    return threads


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (Linux wheels bundle their own); None under another OpenMP
    runtime or without /proc."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1]
        if Path(path).name.startswith("libgomp"):
            return ctypes.CDLL(path)
    return None


def _share_main_heap() -> None:
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "mallopt"):  # glibc; other C libraries manage threads differently
        libc.mallopt(_M_ARENA_MAX, 1)
