"""`--dtype auto`: bf16 only where the CPU computes it natively, from faked CPU flags."""

from __future__ import annotations

import pytest

from deepwell import cpu_dtype
from deepwell.cpu_dtype import cpu_flags, select_dtype
from deepwell.engine import EngineArgs

TORCH_LEVEL = "ATEN_CPU_CAPABILITY"
AVX2_ONLY = frozenset({"fpu", "sse4_2", "avx", "avx2", "fma", "avx512f"})


@pytest.fixture(autouse=True)
def torch_level_uncapped(monkeypatch):
    """The suite may itself run with AVX2 forced; each test sets the cap it is about."""
    monkeypatch.delenv(TORCH_LEVEL, raising=False)


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16", "bf16"])
def test_auto_is_bf16_on_a_cpu_with_native_bf16(flag):
    choice = select_dtype("auto", AVX2_ONLY | {flag})
    assert choice.dtype == "bfloat16" and choice.requested == "auto"
    assert flag in choice.reason


def test_auto_is_float32_without_native_bf16():
    choice = select_dtype("auto", AVX2_ONLY)
    assert choice.dtype == "float32"
    assert "no native bf16" in choice.reason


def test_an_explicit_dtype_is_kept_whatever_the_cpu():
    assert select_dtype("bfloat16", AVX2_ONLY).dtype == "bfloat16"
    assert select_dtype("float32", AVX2_ONLY | {"amx_bf16"}).dtype == "float32"


def test_flags_come_from_x86_flags_and_arm_features_lines(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert select_dtype("auto", cpu_flags(arm)).dtype == "bfloat16"
    assert cpu_flags(tmp_path / "missing") is None


def test_without_cpuinfo_torch_decides(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: None)
    monkeypatch.setattr(cpu_dtype, "_torch_has_native_bf16", lambda: False)
    assert select_dtype("auto").dtype == "float32"
    monkeypatch.setattr(cpu_dtype, "_torch_has_native_bf16", lambda: True)
    assert select_dtype("auto").dtype == "bfloat16"


def test_engine_args_resolve_auto_to_a_torch_dtype(monkeypatch):
    import torch

    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: AVX2_ONLY)
    args = EngineArgs()
    assert args.dtype == "auto" and args.torch_dtype is torch.float32
    assert EngineArgs(dtype="bfloat16").torch_dtype is torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        EngineArgs(dtype="float16")


@pytest.mark.parametrize("level", ["avx2", "AVX2", "default"])
def test_auto_is_float32_where_torch_is_capped_below_avx512(level):
    # An AMX Xeon run with ATEN_CPU_CAPABILITY=avx2: its bf16 instructions are AVX-512 ones.
    choice = select_dtype("auto", AVX2_ONLY | {"avx512_bf16", "amx_bf16"}, {TORCH_LEVEL: level})
    assert choice.dtype == "float32"
    assert f"ATEN_CPU_CAPABILITY={level.lower()}" in choice.reason
    assert "avx512_bf16" in choice.reason


@pytest.mark.parametrize("environ", [{}, {"ATEN_CPU_CAPABILITY": "avx512"}])
def test_auto_keeps_bf16_where_torch_may_use_avx512(environ):
    assert select_dtype("auto", AVX2_ONLY | {"amx_bf16"}, environ).dtype == "bfloat16"


def test_the_avx512_cap_leaves_arms_bf16_alone():
    arm = frozenset({"fp", "asimd", "bf16"})
    assert select_dtype("auto", arm, {TORCH_LEVEL: "default"}).dtype == "bfloat16"


def test_without_cpuinfo_a_capped_torch_decides_float32(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: None)
    monkeypatch.setattr(cpu_dtype, "_torch_has_native_bf16", lambda: True)
    choice = select_dtype("auto", environ={TORCH_LEVEL: "avx2"})
    assert choice.dtype == "float32" and "ATEN_CPU_CAPABILITY=avx2" in choice.reason


def test_auto_reads_the_cap_from_the_process_environment(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: AVX2_ONLY | {"avx512_bf16"})
    monkeypatch.setenv(TORCH_LEVEL, "avx2")
    assert select_dtype("auto").dtype == "float32"
    monkeypatch.delenv(TORCH_LEVEL)
    assert select_dtype("auto").dtype == "bfloat16"
