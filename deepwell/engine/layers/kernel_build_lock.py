"""One kernel build per folder at a time, under a lock file that names its holder (PID, host,
start time). A holder that died, or has held the lock past its limit, is taken over; a
waiter logs what it waits for and gives up after a limit, so no start waits forever.

torch's own `lock` file (cpp_extension's FileBaton) names nobody and outlives a build that
was killed: every later process then waits on it in silence. Under this lock no live
deepwell process is building in the folder, so a `lock` file found there is stale and goes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = "deepwell-build.lock"
# Held only while the lock file is read, judged and written: a flock, which the kernel drops
# when its holder dies, so the guard itself cannot wedge anybody.
GUARD_NAME = "deepwell-build.guard"
TORCH_LOCK_NAME = "lock"


class KernelBuildWaitTimeout(TimeoutError):
    """Another live process held the build lock for longer than this one would wait."""


@dataclass(frozen=True)
class LockHolder:
    pid: int
    host: str
    # Seconds since the epoch (time.time()): comparable across processes, unlike monotonic.
    started: float
    what: str

    def describe(self, now: float) -> str:
        return (
            f"PID {self.pid} on {self.host}, building the {self.what} "
            f"for {max(0.0, now - self.started):.0f} s"
        )


def _read_holder(path: Path) -> LockHolder | None:
    """The holder written in the lock file; None when there is no file. A file that does not
    parse (written by something else) is a holder nobody can be waiting for: pid 0."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        fields = json.loads(text)
        return LockHolder(
            int(fields["pid"]), str(fields["host"]), float(fields["started"]), str(fields["what"])
        )
    except (ValueError, KeyError, TypeError):
        return LockHolder(0, "?", 0.0, "unknown kernel (unreadable lock file)")


def _is_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start_time(pid: int) -> float | None:
    """When process `pid` started, in seconds since the epoch (Linux's /proc); None where it
    cannot be read."""
    try:
        # Field 22, counted after the parenthesised name (which may hold spaces).
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return int(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return None


def stale_reason(holder: LockHolder, now: float, stale_seconds: float) -> str | None:
    """Why a holder no longer counts, or None while it does. A PID is checked only on this
    host; a holder on another (a shared home directory) goes stale by age alone."""
    here = holder.host == socket.gethostname()
    if here and not _is_alive(holder.pid):
        return "its process is gone"
    if now - holder.started > stale_seconds:
        return f"it has held the lock for over {stale_seconds:.0f} s"
    started = process_start_time(holder.pid) if here else None
    # A second's slack: btime and the tick count are coarse.
    if started is not None and started > holder.started + 1:
        return f"its PID now names a process started after the lock ({started:.0f})"
    return None


@contextlib.contextmanager
def _guard(directory: Path) -> Iterator[None]:
    with open(directory / GUARD_NAME, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _try_take(directory: Path, what: str, stale_seconds: float) -> tuple[LockHolder, bool]:
    """Takes the lock if it is free or stale (logged): the holder now, and whether it is us."""
    path = directory / LOCK_NAME
    with _guard(directory):
        holder = _read_holder(path)
        if holder is not None:
            reason = stale_reason(holder, time.time(), stale_seconds)
            if reason is None:
                return holder, False
            logger.warning(
                "taking over the kernel build lock in %s from %s: %s",
                directory,
                holder.describe(time.time()),
                reason,
            )
        me = LockHolder(os.getpid(), socket.gethostname(), time.time(), what)
        written = path.with_name(f"{LOCK_NAME}.{me.pid}")
        written.write_text(json.dumps(asdict(me)))
        os.replace(written, path)
        (directory / TORCH_LOCK_NAME).unlink(missing_ok=True)
    return me, True


def _release(directory: Path, me: LockHolder) -> None:
    with _guard(directory):
        # Only our own: after a takeover the file names the process that took it.
        if _read_holder(directory / LOCK_NAME) == me:
            (directory / LOCK_NAME).unlink(missing_ok=True)


@contextlib.contextmanager
def kernel_build_lock(
    directory: Path,
    what: str,
    *,
    wait_seconds: float,
    stale_seconds: float,
    poll_seconds: float = 0.5,
) -> Iterator[None]:
    """Holds the build lock of `directory` for the block. Waits for a live holder at most
    `wait_seconds` (then KernelBuildWaitTimeout), logging once whom it waits for; takes over
    from a holder whose process is gone or that has held it over `stale_seconds`."""
    directory.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_seconds
    announced = False
    while True:
        holder, ours = _try_take(directory, what, stale_seconds)
        if ours:
            break
        if time.monotonic() >= deadline:
            raise KernelBuildWaitTimeout(
                f"waited {wait_seconds:.0f} s for {holder.describe(time.time())} in {directory}"
            )
        if not announced:
            logger.warning(
                "waiting for %s in %s (at most %.0f s, then the torch path)",
                holder.describe(time.time()),
                directory,
                wait_seconds,
            )
            announced = True
        time.sleep(poll_seconds)
    try:
        yield
    finally:
        _release(directory, holder)
