"""The kernel build's lock: a build killed midway never blocks the next process; the build's
key: each checkout of the same sources builds in its own folder."""

import fcntl
import shutil

import pytest

from deepwell.engine.layers.decode_kernel import SOURCE, _build_key, _build_lock


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


def test_two_checkouts_of_the_same_sources_build_in_two_folders(tmp_path):
    # torch's build file names each source by its path: a shared folder would be rebuilt
    # whenever the other checkout had used it last.
    copy = tmp_path / SOURCE.name
    shutil.copy(SOURCE, copy)
    assert _build_key((SOURCE,), ["-O3"]) == _build_key((SOURCE,), ["-O3"])
    assert _build_key((copy,), ["-O3"]) != _build_key((SOURCE,), ["-O3"])
