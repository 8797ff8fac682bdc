"""The build's key: every checkout of the same sources shares one build; the forced
paths the tests check are built lighter than the native one. (The build's lock:
test_kernel_build_lock.py.)"""

import platform
import shutil

import pytest
import torch

from deepwell.engine.layers.decode_kernel import (
    BLOCKSCALED_PATH_FLAGS,
    FORCED_PATH_OPTIMISATION,
    HEADER,
    KERNEL_BUILDS,
    QUANT_PATH_FLAGS,
    SOURCE,
    _build_key,
    _staged_sources,
    _vector_flags,
)


def test_two_checkouts_of_the_same_sources_share_one_build(tmp_path):
    copy = tmp_path / SOURCE.name
    shutil.copy(SOURCE, copy)
    assert _build_key((copy,), ["-O3"]) == _build_key((SOURCE,), ["-O3"])
    copy.write_text(SOURCE.read_text() + "\n// changed\n")
    assert _build_key((copy,), ["-O3"]) != _build_key((SOURCE,), ["-O3"])
    assert _build_key((SOURCE,), ["-O1"]) != _build_key((SOURCE,), ["-O3"])


def test_the_build_compiles_copies_kept_in_its_own_folder(tmp_path):
    # torch's build file names each source by its path: naming the checkout's own files
    # would rebuild whenever another checkout had used the folder last.
    staged = _staged_sources((SOURCE,), tmp_path)
    assert staged == [str(tmp_path / "sources" / SOURCE.name)]
    assert (tmp_path / "sources" / SOURCE.name).read_bytes() == SOURCE.read_bytes()
    assert (tmp_path / "sources" / HEADER.name).read_bytes() == HEADER.read_bytes()
    written = (tmp_path / "sources" / SOURCE.name).stat().st_mtime_ns
    _staged_sources((SOURCE,), tmp_path)
    assert (tmp_path / "sources" / SOURCE.name).stat().st_mtime_ns == written


def test_only_the_forced_paths_are_built_at_a_lower_optimisation():
    for flags in (QUANT_PATH_FLAGS, BLOCKSCALED_PATH_FLAGS):
        assert FORCED_PATH_OPTIMISATION not in flags["native"]
        assert all(FORCED_PATH_OPTIMISATION in flags[path] for path in ("avx2", "scalar"))


def test_build_kernels_covers_every_kernel_and_marks_the_test_only_ones():
    names = [kernel.name for kernel in KERNEL_BUILDS]
    assert len(names) == len(set(names)) == 17
    assert sorted(kernel.name for kernel in KERNEL_BUILDS if kernel.test_only) == sorted(
        f"{kind} ({path}, forced)"
        for kind in ("block-scaled linear", "quantised linear")
        for path in ("avx2", "scalar")
    )


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86's instruction-set flags")
def test_kernels_compile_no_higher_than_torchs_forced_avx2_level(monkeypatch):
    # ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU: -march=native alone would keep our
    # kernels on AVX-512, so a forced-AVX2 measurement would not be one.
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    capability, flags = _vector_flags()
    assert capability == "AVX2" and "-DCPU_CAPABILITY_AVX2" in flags
    assert flags.index("-mno-avx512f") > flags.index("-march=native")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert "-mno-avx512f" not in _vector_flags()[1]
