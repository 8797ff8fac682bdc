"""The kernel build lock: a holder killed mid-build never blocks the next process, a hung one
is taken over after its limit, and a waiter says whom it waits for and gives up in time."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deepwell.engine.layers.decode_kernel import load_decode_kernel
from deepwell.engine.layers.kernel_build_lock import (
    LOCK_NAME,
    TORCH_LOCK_NAME,
    KernelBuildWaitTimeout,
    kernel_build_lock,
    process_start_time,
)

ROOT = Path(__file__).resolve().parents[3]
# Holds the lock and leaves torch's FileBaton file beside it, as a build in progress does.
HOLDER = """
import sys, time
from pathlib import Path
from deepwell.engine.layers.kernel_build_lock import kernel_build_lock
directory = Path(sys.argv[1])
with kernel_build_lock(directory, "test kernel", wait_seconds=5, stale_seconds=3600):
    (directory / "lock").touch()
    print("building", flush=True)
    time.sleep(600)
"""


def _write_holder(directory: Path, pid: int, started: float, host: str | None = None) -> None:
    fields = {"pid": pid, "host": host or socket.gethostname(), "started": started, "what": "x"}
    (directory / LOCK_NAME).write_text(json.dumps(fields))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_build_killed_midway_does_not_block_the_next_one(tmp_path, caplog):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout.readline().strip() == "building"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / TORCH_LOCK_NAME).exists()  # what used to wedge every later start
    started = time.monotonic()
    with (
        caplog.at_level(logging.WARNING),
        kernel_build_lock(tmp_path, "test kernel", wait_seconds=30, stale_seconds=3600),
    ):
        assert not (tmp_path / TORCH_LOCK_NAME).exists()
    assert time.monotonic() - started < 10
    assert f"from PID {holder.pid} on" in caplog.text
    assert "its process is gone" in caplog.text
    assert not (tmp_path / LOCK_NAME).exists()  # released after the block


def test_a_waiter_names_the_live_holder_and_gives_up_after_its_limit(tmp_path, caplog):
    _write_holder(tmp_path, os.getpid(), time.time())  # alive: this very process
    started = time.monotonic()
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(KernelBuildWaitTimeout, match=f"PID {os.getpid()}"),
        kernel_build_lock(tmp_path, "y", wait_seconds=1, stale_seconds=3600, poll_seconds=0.1),
    ):
        pass
    assert 1 <= time.monotonic() - started < 10
    assert f"waiting for PID {os.getpid()}" in caplog.text
    assert "at most 1 s, then the torch path" in caplog.text
    assert caplog.text.count("waiting for") == 1  # one line, not one per poll


def test_a_waiter_takes_the_lock_when_the_holder_lets_go(tmp_path):
    holding = threading.Event()
    done = threading.Event()

    def hold() -> None:
        with kernel_build_lock(tmp_path, "first", wait_seconds=5, stale_seconds=3600):
            holding.set()
            time.sleep(0.5)
        done.set()

    thread = threading.Thread(target=hold)
    thread.start()
    holding.wait(5)
    with kernel_build_lock(
        tmp_path, "second", wait_seconds=10, stale_seconds=3600, poll_seconds=0.05
    ):
        assert done.is_set()
        assert json.loads((tmp_path / LOCK_NAME).read_text())["what"] == "second"
    thread.join()


@pytest.mark.parametrize(
    "pid, age, host, why",
    [
        ("dead", 0, None, "its process is gone"),
        ("alive", 7200, None, "held the lock for over 3600 s"),
        ("alive", 7200, "another-host", "held the lock for over 3600 s"),
    ],
)
def test_a_stale_holder_is_taken_over_and_logged(tmp_path, caplog, pid, age, host, why):
    holder = _dead_pid() if pid == "dead" else os.getpid()
    _write_holder(tmp_path, holder, time.time() - age, host)
    with (
        caplog.at_level(logging.WARNING),
        kernel_build_lock(tmp_path, "z", wait_seconds=0, stale_seconds=3600),
    ):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"taking over the kernel build lock in {tmp_path} from PID {holder}" in caplog.text
    assert why in caplog.text


def test_a_live_holder_on_another_host_is_waited_for_until_it_is_old(tmp_path):
    # Its PID means nothing here (a shared home directory): only its age counts.
    _write_holder(tmp_path, _dead_pid(), time.time(), "another-host")
    with (
        pytest.raises(KernelBuildWaitTimeout, match="another-host"),
        kernel_build_lock(tmp_path, "z", wait_seconds=0.2, stale_seconds=3600, poll_seconds=0.05),
    ):
        pass


def test_an_unreadable_lock_file_is_taken_over(tmp_path, caplog):
    (tmp_path / LOCK_NAME).write_text("not json")
    with (
        caplog.at_level(logging.WARNING),
        kernel_build_lock(tmp_path, "z", wait_seconds=0, stale_seconds=3600),
    ):
        pass
    assert "unreadable lock file" in caplog.text


def _start_in_a_subprocess(env: dict[str, str]) -> subprocess.CompletedProcess:
    script = (
        "from deepwell.engine.layers.decode_kernel import load_decode_kernel\n"
        "loaded = load_decode_kernel()\n"
        "print('served by the kernel' if loaded.module is not None else loaded.reason)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1500
    )


def test_the_next_start_loads_the_kernel_after_a_holder_was_killed_in_its_folder():
    # The kernel as built (by `deepwell build-kernels` or the tests before); a process killed
    # while building in its folder leaves both lock files behind.
    built = load_decode_kernel()
    if built.module is None:
        pytest.skip(f"no decode kernel here: {built.reason}")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(built.directory)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout.readline().strip() == "building"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (built.directory / TORCH_LOCK_NAME).exists()
    started = time.monotonic()
    started_again = _start_in_a_subprocess(env)
    assert started_again.stdout.strip() == "served by the kernel", started_again.stderr
    assert f"from PID {holder.pid}" in started_again.stderr  # the takeover, logged
    assert time.monotonic() - started < 300


@pytest.mark.slow
def test_a_start_killed_inside_the_compiler_leaves_a_build_the_next_start_completes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    first = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from deepwell.engine.layers.decode_kernel import "
            "load_decode_kernel; load_decode_kernel()",
        ],
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 900
    while not list(tmp_path.glob("*/build.ninja")) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(5)  # into the compiler
    os.killpg(first.pid, signal.SIGKILL)  # the process, ninja and the compiler: an OOM kill
    first.wait()
    assert list(tmp_path.glob(f"*/{LOCK_NAME}")), "the first start was not building"
    assert list(tmp_path.glob(f"*/{TORCH_LOCK_NAME}"))
    second = _start_in_a_subprocess(env)
    assert second.stdout.strip() == "served by the kernel", second.stderr
    assert "its process is gone" in second.stderr


def test_a_holder_whose_pid_now_names_a_younger_process_is_taken_over(tmp_path, caplog):
    # This process as the "holder" of a lock written a minute before it started: a PID reused.
    this_process_started = process_start_time(os.getpid())
    assert this_process_started is not None and abs(this_process_started - time.time()) < 86400
    _write_holder(tmp_path, os.getpid(), this_process_started - 60)
    with (
        caplog.at_level(logging.WARNING),
        kernel_build_lock(tmp_path, "z", wait_seconds=0, stale_seconds=3600),
    ):
        pass
    assert "its PID now names a process started after the lock" in caplog.text
