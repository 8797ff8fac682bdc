"""`deepwell build-kernels`: every kernel reported, one line each, and a machine without a
compiler told that the torch path serves instead (exit 0: the engine runs without them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from deepwell import cli

ROOT = Path(__file__).resolve().parents[1]


def test_without_a_compiler_every_kernel_is_reported_unavailable(tmp_path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CXX": str(tmp_path / "no-such-c++"),
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "deepwell.cli", "build-kernels", "--test-paths", "--jobs", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "building 17 kernels, 2 at a time"
    unavailable = [line for line in lines if "unavailable, the torch path serves" in line]
    assert len(unavailable) == 17
    assert all("no C++ compiler" in line for line in unavailable)
    assert lines[-1].startswith("0 of 17 kernels ready in ")
    assert not (tmp_path / "cache").exists()  # nothing was started


def test_build_kernels_refuses_no_jobs(capsys) -> None:
    assert cli.main(["build-kernels", "--jobs", "0"]) == 2
    assert "--jobs must be at least 1, got 0" in capsys.readouterr().err
