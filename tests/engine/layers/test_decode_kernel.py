"""The kernel build's lock: a build killed midway never blocks the next process."""

import fcntl

import pytest

from deepwell.engine.layers.decode_kernel import _build_lock


def test_a_lock_file_left_by_a_killed_build_is_cleared(tmp_path):
    (tmp_path / "lock").touch()  # what torch's FileBaton leaves when its build is killed
    with _build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_the_build_lock_is_held_exclusively_while_building(tmp_path):
    with (
        _build_lock(tmp_path),
        open(tmp_path / "deepwell.lock", "a") as other,
        pytest.raises(BlockingIOError),
    ):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / "deepwell.lock", "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after the build
