"""The wheel: a non-editable install carries everything `deepwell generate` reads at run time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _build_wheel(tmp_path: Path) -> Path:
    """Build from a copy of the sources, so the worktree gets no build/ or egg-info."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "deepwell", source / "deepwell", ignore=shutil.ignore_patterns("__pycache__")
    )
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(wheels), str(source)],
        check=True,
    )
    (wheel,) = wheels.glob("deepwell-*.whl")
    return wheel


@pytest.mark.slow
def test_the_installed_wheel_answers_a_prompt_on_the_embedded_model(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q"]
        + [str(wheel)],
        check=True,
    )
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # The dependencies (torch, the embedded model's package) from this interpreter's
    # environment, after the wheel's own deepwell on the path; a plain path line, so its
    # editable deepwell's finder stays out.
    (site / "shared-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = site / "deepwell"
    assert (installed / "engine" / "layers" / "kernel_parts.h").is_file()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    answer = subprocess.run(
        [str(venv / "bin" / "deepwell"), "generate", "--raw", "--max-tokens", "4", "Hello"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip()
    where = subprocess.run(
        [str(python), "-c", "import deepwell; print(deepwell.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(where.stdout.strip()).is_relative_to(installed)
