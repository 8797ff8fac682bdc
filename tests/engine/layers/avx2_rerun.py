"""Rerun some of a test file's tests in a process whose torch runs at its AVX2 level."""

import os
import subprocess
import sys


def rerun_at_avx2(test_file: str, selection: str) -> subprocess.CompletedProcess:
    """pytest on `test_file`'s tests matching `-k selection`, with ATEN_CPU_CAPABILITY=avx2
    (and so every kernel built at that level, as decode_kernel.py builds at torch's)."""
    environ = os.environ | {"ATEN_CPU_CAPABILITY": "avx2"}
    command = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*command, "-k", selection],
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
