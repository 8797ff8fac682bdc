"""The engine worker processes `deepwell serve` starts: each in a session of its own, so that
it and every process it starts (a kernel build's ninja and compilers) end together."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from deepwell.serve.messages import WorkerConfig, encode_message

logger = logging.getLogger("deepwell.serve")

# How long a worker that reads its inbox gets to drain and exit after its `Shutdown`.
WORKER_EXIT_TIMEOUT_S = 10.0
# How long a terminated worker gets to release what it holds on the way out (the kernel
# build lock, torch's build lock) before what is left of its session is killed.
TERMINATE_GRACE_S = 3.0
_POLL_S = 0.05
_PROC = Path("/proc")
# linux/prctl.h: deliver a signal to this process when its parent dies.
_PR_SET_PDEATHSIG = 1


def start_worker(config: WorkerConfig) -> subprocess.Popen:
    """`python -m deepwell.serve.worker` in a new session. ninja puts each compiler in a
    process group of its own, but within the session, so the session is what holds all of
    a worker. A Ctrl-C in a terminal then reaches the server alone, which stops its workers.
    Call it on the server's event-loop thread, which lives as long as the server: Linux sends
    the worker's parent-death signal (`end_with_server`) when the thread that started it
    ends."""
    return subprocess.Popen(
        [sys.executable, "-m", "deepwell.serve.worker", encode_message(config).hex()],
        start_new_session=True,
    )


def stop_worker(worker: subprocess.Popen, reads_inbox: bool) -> None:
    """Waits for a worker that reads its inbox, and so has its `Shutdown`, to exit (at most
    WORKER_EXIT_TIMEOUT_S); terminates at once one that does not (still loading, or given
    up on), which would never exit on its own, with its whole session."""
    if reads_inbox:
        try:
            worker.wait(WORKER_EXIT_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            logger.warning("worker %s did not exit; terminating it", worker.pid)
    _terminate_session(worker)


def end_with_server(server_pid: int) -> None:
    """In a worker: Linux sends it SIGTERM when the server that started it dies, however it
    died, SIGKILL included (the parent-death signal). A loading worker reads no inbox and
    would otherwise load, and compile, for a server that is gone; a loaded one also notices
    in its loop. Nothing where there is no prctl (not Linux)."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != server_pid:  # it died before the call
        os.kill(os.getpid(), signal.SIGTERM)


def end_own_session() -> None:
    """In a worker that leads its session: SIGTERM to the session's other processes (a kernel
    build's ninja and compilers), which a parent-death signal to the worker alone leaves."""
    me = os.getpid()
    if os.getsid(0) != me:
        return
    for pid in _session_members(me):
        if pid != me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


def kill_worker(worker: subprocess.Popen) -> None:
    """SIGKILL to a hung worker and every process of its session, without waiting."""
    _signal_session(worker.pid, signal.SIGKILL)


def _terminate_session(worker: subprocess.Popen) -> None:
    """SIGTERM to every process of the worker's session (it leads it), then SIGKILL to those
    still there after TERMINATE_GRACE_S; reaps the worker. The session's id, the worker's
    PID, names no other process while the worker is unreaped or any of its session lives."""
    if not _session_ends_on(worker, signal.SIGTERM):
        logger.warning("worker %s did not stop on SIGTERM; killing it", worker.pid)
        _session_ends_on(worker, signal.SIGKILL)
    worker.wait()


def _session_ends_on(worker: subprocess.Popen, sig: signal.Signals) -> bool:
    """Sends `sig` to the worker's session: whether all of it ended within TERMINATE_GRACE_S."""
    _signal_session(worker.pid, sig)
    deadline = time.monotonic() + TERMINATE_GRACE_S
    while worker.poll() is None or _session_members(worker.pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _signal_session(session: int, sig: signal.Signals) -> None:
    if not _PROC.is_dir():  # no /proc (macOS): the leader's process group, ninja in it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(session, sig)
        return
    for pid in _session_members(session):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _session_members(session: int) -> list[int]:
    """The processes of `session` that still run (zombies aside), from Linux's /proc; none
    where there is no /proc."""
    if not _PROC.is_dir():
        return []
    members = []
    for entry in os.listdir(_PROC):
        if not entry.isdigit():
            continue
        try:
            # Fields after the parenthesised name (which may hold spaces): state, ppid,
            # process group, session.
            fields = (_PROC / entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == session:
            members.append(int(entry))
    return members
