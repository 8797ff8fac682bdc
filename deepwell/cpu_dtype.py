"""`--dtype auto`: bf16 where the CPU computes it natively, float32 everywhere else.

On a CPU without native bf16 (AVX2-only x86, older Xeons and EPYCs) a bf16 linear runs
about 8× slower than float32 (issue #16), so bf16 is chosen only on proof of hardware
support, and only where torch may use it. Torch-free, so the command line and the HTTP
process can read it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"
# /proc/cpuinfo flags that mean native bf16 arithmetic: x86 AVX512_BF16 and AMX-BF16
# (`flags` line), Arm's BF16 extension (`Features` line).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# The x86 ones are AVX-512-level instructions: torch's kernels use them only at its AVX512
# level, so ATEN_CPU_CAPABILITY naming a lower one (avx2, default) takes them away, and bf16
# then runs as on an AVX2-only CPU (W ~8x slower than float32; issue 33).
X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class DtypeChoice:
    """The compute dtype an engine runs in, what was asked for, and why."""

    dtype: str
    requested: str
    reason: str


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str] | None:
    """The CPU feature flags /proc/cpuinfo lists (x86 `flags`, Arm `Features`); None where
    there is no such file (macOS, Windows)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def _torch_has_native_bf16() -> bool:
    """Torch's own CPU probe, for systems without /proc/cpuinfo (its x86 checks only)."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def torch_level_below_avx512(environ: Mapping[str, str]) -> str | None:
    """The level ATEN_CPU_CAPABILITY caps torch's kernels at where it is below AVX-512
    ("avx2", "default"), else None (unset, or avx512)."""
    level = environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not level or level.startswith("avx512"):
        return None
    return level


def select_dtype(
    requested: str,
    flags: frozenset[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> DtypeChoice:
    """The dtype to compute in: `requested` itself, or for `auto` the CPU's best at the level
    torch is allowed to run at.

    `flags` defaults to this machine's (`cpu_flags()`), `environ` to this process's; tests
    pass fake ones.
    """
    if requested != AUTO:
        return DtypeChoice(requested, requested, "asked for")
    if flags is None:
        flags = cpu_flags()
    level = torch_level_below_avx512(os.environ if environ is None else environ)
    if flags is None:
        if level is None and _torch_has_native_bf16():
            return DtypeChoice("bfloat16", AUTO, "torch reports native bf16 on this CPU")
        if level is None:
            return DtypeChoice("float32", AUTO, "no /proc/cpuinfo and torch finds no native bf16")
        return _capped(level, "torch's x86 bf16 probes")
    native = sorted(set(NATIVE_BF16_FLAGS) & flags)
    if level is not None:
        unusable = [flag for flag in native if flag in X86_BF16_FLAGS]
        native = [flag for flag in native if flag not in X86_BF16_FLAGS]
        if unusable and not native:
            return _capped(level, ", ".join(unusable))
    if native:
        return DtypeChoice(
            "bfloat16", AUTO, f"the CPU computes bf16 natively ({', '.join(native)})"
        )
    return DtypeChoice(
        "float32",
        AUTO,
        "the CPU has no native bf16 (none of " + ", ".join(NATIVE_BF16_FLAGS) + "), "
        "where bf16 runs several times slower than float32",
    )


def _capped(level: str, bf16_support: str) -> DtypeChoice:
    return DtypeChoice(
        "float32",
        AUTO,
        f"ATEN_CPU_CAPABILITY={level} keeps torch below AVX-512, so the CPU's bf16 "
        f"({bf16_support}) goes unused and bf16 would run several times slower than float32",
    )
