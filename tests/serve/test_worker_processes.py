"""Stopping a worker process: its whole session ends, whatever process group a member is in."""

from __future__ import annotations

import signal
import subprocess
import sys

from servers import is_running

from deepwell.serve.worker_processes import stop_worker

# A worker stand-in that ignores SIGTERM (stuck in a long native call), with a child that
# does too in a process group of its own, as ninja starts its compilers.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"],
    process_group=0)
print(child.pid, flush=True)
time.sleep(600)
"""


def _stubborn_worker() -> tuple[subprocess.Popen, int]:
    worker = subprocess.Popen(
        [sys.executable, "-c", STUBBORN],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines = {worker.stdout.readline().strip(), worker.stdout.readline().strip()}
    lines.remove("ready")
    return worker, int(lines.pop())


def test_a_loading_worker_and_its_other_group_are_killed_when_sigterm_does_not_end_them():
    worker, child = _stubborn_worker()
    try:
        stop_worker(worker, reads_inbox=False)
        assert worker.returncode == -signal.SIGKILL
        assert not is_running(child)
    finally:
        worker.kill()
        worker.stdout.close()


def test_a_worker_that_exits_on_its_shutdown_is_left_to_do_so():
    worker = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    stop_worker(worker, reads_inbox=True)
    assert worker.returncode == 0
