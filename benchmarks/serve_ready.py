"""Seconds from spawning `deepwell serve` to its first 200 on /v1/models, and the CPU seconds
the server and its workers spent by then: what `make run` and a restart make a user wait.

Run it from each tree in turn (A B A B); arguments after the port go to `deepwell serve`
(e.g. `--threads 1`, steadier than two threads on a shared 2-vCPU machine):

    .venv/bin/python benchmarks/serve_ready.py TREE [PORT] [-- serve arguments...]
"""

import os
import signal
import subprocess
import sys
import time
import urllib.request


def group_cpu_seconds(group: int) -> float:
    """User + system CPU seconds of the live processes in process group `group` (Linux)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone since the listing
        if int(fields[2]) == group:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


def main() -> None:
    tree = sys.argv[1]
    port = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "--" else 18420
    serve_args = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else []
    command = [sys.executable, "-c", "from deepwell.cli import main; main()", "serve"]
    started = time.perf_counter()
    server = subprocess.Popen(
        [*command, "--port", str(port), *serve_args],
        cwd=tree,
        env=dict(os.environ, PYTHONPATH=tree),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        while not ready(port):
            if server.poll() is not None:
                sys.exit(f"deepwell serve exited:\n{server.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
        wall = time.perf_counter() - started
        print(f"ready in {wall:.2f} s wall, {group_cpu_seconds(server.pid):.2f} CPU s")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


if __name__ == "__main__":
    main()
