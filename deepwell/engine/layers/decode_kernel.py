"""Builds and loads the C++ decode kernels (paged_decode.cpp: paged attention, with
llama_glue.cpp's fused norms and activations beside it; quant_gemv.cpp:
GGUF-block linears; llama_decode.cpp: a whole Llama decode step on GGUF blocks, and
llama_dense_decode.cpp: one on dense weights, compiled with the other two into one extension,
one translation unit; blockscaled.cpp: linears on DeepSeek-V4.1's FP8 / MXFP4 / bf16
weights; hyper_connection.cpp: V4.1's mHC per row; v41_cache_rows.cpp: V4.1's packed cache rows;
v41_rotary.cpp: V4.1's rotary embedding; invariant_rows.cpp: the batch-invariant mode's row-wise
products; prefill_attention.cpp: prefill chunks' attention; llama_rotary.cpp: the Llama
family's rotary embedding; bf16_gemm.cpp: bf16 linears of decode-shaped steps;
amx_linear.cpp: the batch-invariant mode's bf16 linears on AMX tiles):
compiled once per machine into the torch extensions cache, up front by `deepwell
build-kernels` (`build_kernels`) or on first use, each under the folder's build lock
(layers/kernel_build_lock.py), and loaded from there after.

Nothing here runs at import: only an engine that decodes asks for a kernel, so commands
that never decode never compile. The build uses the local C++ compiler and ninja only; it
downloads nothing.
"""

import concurrent.futures
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from deepwell.engine.layers.kernel_build_lock import KernelBuildWaitTimeout, kernel_build_lock

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.cpp")
# Rides in the attention extension, which the C++ backend builds anyway: no extra build.
GLUE_SOURCE = Path(__file__).with_name("llama_glue.cpp")
QUANT_SOURCE = Path(__file__).with_name("quant_gemv.cpp")
# The dense decoder last: it calls paged_decode.cpp's entry points.
LLAMA_SOURCES = (
    Path(__file__).with_name("llama_decode.cpp"),
    SOURCE,
    QUANT_SOURCE,
    Path(__file__).with_name("llama_dense_decode.cpp"),
)
BLOCKSCALED_SOURCE = Path(__file__).with_name("blockscaled.cpp")
HYPER_CONNECTION_SOURCE = Path(__file__).with_name("hyper_connection.cpp")
CACHE_ROWS_SOURCE = Path(__file__).with_name("v41_cache_rows.cpp")
ROTARY_SOURCE = Path(__file__).with_name("v41_rotary.cpp")
SAMPLING_SOURCE = Path(__file__).with_name("sampling_ops.cpp")
INVARIANT_ROWS_SOURCE = Path(__file__).with_name("invariant_rows.cpp")
PREFILL_SOURCE = Path(__file__).with_name("prefill_attention.cpp")
LLAMA_ROTARY_SOURCE = Path(__file__).with_name("llama_rotary.cpp")
BF16_GEMM_SOURCE = Path(__file__).with_name("bf16_gemm.cpp")
AMX_LINEAR_SOURCE = Path(__file__).with_name("amx_linear.cpp")
# Named rather than left to -march=native's detection (which finds them on an AMX Xeon with
# gcc 12), and passed only where the CPU and torch's level have them: a tile instruction
# elsewhere faults.
AMX_FLAGS = ["-mamx-tile", "-mamx-bf16"]
# What the sources share: its changes must change every build key.
HEADER = Path(__file__).with_name("kernel_parts.h")
# The one file a build of several sources compiles: it includes them all (`_staged_sources`).
UNITY_SOURCE = "unity.cpp"
# A cold build on a 2-core machine (gcc 12, torch 2.13 headers; 12-35 CPU s each, the
# biggest block-scaled): what the log line quotes.
BUILD_SECONDS = 30
# How long a start waits for another live process's build of the same kernel before it
# takes the torch path: a cold build took up to 13 minutes on a shared, loaded 2-core VM.
BUILD_WAIT_SECONDS = 1200.0
# A holder this old is taken to be hung (or its PID reused) and its lock is taken over.
BUILD_STALE_SECONDS = 3600.0
# The forced lower paths below exist for the tests to check, never to serve: -O1 (the later
# -O wins) takes about a quarter off their compile, most of it being torch's headers.
FORCED_PATH_OPTIMISATION = "-O1"
# quant_gemv.cpp's instruction-set paths: "native" takes the best this CPU has; the others
# force a lower one (the tests build each to keep them all checked).
QUANT_PATH_FLAGS = {
    "native": [],
    "avx2": ["-DDEEPWELL_QUANT_AVX2", FORCED_PATH_OPTIMISATION],
    "scalar": ["-DDEEPWELL_QUANT_SCALAR", FORCED_PATH_OPTIMISATION],
}

# blockscaled.cpp's instruction-set paths, alike: AVX-512 at best, forced AVX2, scalar.
BLOCKSCALED_PATH_FLAGS = {
    "native": [],
    "avx2": ["-DDEEPWELL_BLOCKSCALED_AVX2", FORCED_PATH_OPTIMISATION],
    "scalar": ["-DDEEPWELL_BLOCKSCALED_SCALAR", FORCED_PATH_OPTIMISATION],
}


@dataclass(frozen=True)
class DecodeKernel:
    """The loaded extension, or None with the reason it is not there; the folder it was
    built in, where it got that far."""

    module: ModuleType | None
    reason: str
    directory: Path | None = None


def _vector_flags() -> tuple[str, list[str]]:
    """The ATen vector width to compile for (torch's own dispatch level on this CPU), and the
    compiler flags for it. -march=native lets the compiler use every instruction this CPU
    has, so the build is keyed by the CPU (`_build_name`); but not above torch's level: with
    ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU, our kernels take their AVX2 paths too (what
    an AVX2-only CPU runs, measured on this one)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
        if capability == "AVX2":
            flags.append("-mno-avx512f")
    # ATen's Vectorized<float> uses intrinsics only under these macros (else plain arrays).
    level = {"AVX512": "AVX512", "AVX2": "AVX2"}.get(capability)
    if level is not None:
        flags += [f"-DCPU_CAPABILITY={level}", f"-DCPU_CAPABILITY_{level}"]
    return capability, flags


def _build_key(sources: tuple[Path, ...], flags: list[str]) -> str:
    """A digest of the sources and their header, the flags, torch's version and the CPU's
    model and features: a build made with -march=native for one CPU must not load on another
    sharing the same home directory, and a changed source is a new build (announced as one).
    The sources' folder is not: the build compiles copies kept in its own folder
    (`_staged_sources`), so every checkout and install of the same sources shares one build."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = [platform.processor()]
    wanted = ("model name", "flags", "Features", "CPU part")
    described = sorted({line for line in lines if line.startswith(wanted)})
    texts = [f"{path.name}\n{path.read_text()}" for path in (*sources, HEADER)]
    parts = [*texts, *flags, torch.__version__, platform.machine(), *described]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def _build_directory(name: str) -> Path:
    """torch's extensions cache (TORCH_EXTENSIONS_DIR, else under ~/.cache), one folder per
    build key."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _staged_sources(sources: tuple[Path, ...], directory: Path) -> list[str]:
    """Copies of the sources and their header in the build folder, written once (the build
    key covers their text): torch's ninja file names each source by its path and rebuilds when
    one changes, so the build must not name a checkout's own files.

    Several sources compile as one translation unit that includes them all: most of a
    compile is torch's headers, which one unit parses once."""
    staged = directory / "sources"
    staged.mkdir(exist_ok=True)
    files = {path.name: path.read_bytes() for path in (*sources, HEADER)}
    if len(sources) > 1:
        files[UNITY_SOURCE] = "".join(f'#include "{path.name}"\n' for path in sources).encode()
    for name, text in files.items():
        copy = staged / name
        if not copy.is_file() or copy.read_bytes() != text:
            partial = copy.with_suffix(copy.suffix + ".partial")
            partial.write_bytes(text)
            partial.replace(copy)
    compiled = [UNITY_SOURCE] if len(sources) > 1 else [path.name for path in sources]
    return [str(staged / name) for name in compiled]


def _put_installed_ninja_on_path() -> None:
    """The `ninja` wheel (a dependency) installs its binary beside this interpreter's
    scripts, which are not on PATH unless the environment is activated; torch runs
    `ninja` from PATH."""
    scripts = sysconfig.get_path("scripts")
    on_path = os.environ.get("PATH", "").split(os.pathsep)
    if scripts not in on_path and (Path(scripts) / "ninja").exists():
        os.environ["PATH"] = os.pathsep.join([*on_path, scripts])


def _missing_tool() -> str | None:
    from torch.utils.cpp_extension import is_ninja_available

    _put_installed_ninja_on_path()
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    if not is_ninja_available():
        return "no ninja build tool on PATH"
    return None


@functools.cache
def load_decode_kernel() -> DecodeKernel:
    """The attention kernel (and the glue ops it registers, layers/fused_glue.py), built on
    the first call in a process if the cache lacks it."""
    return _load((SOURCE, GLUE_SOURCE), "decode attention kernel", [])


@functools.cache
def load_quant_kernel(path: str = "native") -> DecodeKernel:
    """The GGUF-block linears (quant_gemv.cpp) on the instruction-set `path`
    (QUANT_PATH_FLAGS), built on the first call in a process if the cache lacks it."""
    return _load((QUANT_SOURCE,), f"quantised linear kernel ({path})", QUANT_PATH_FLAGS[path])


@functools.cache
def load_blockscaled_kernel(path: str = "native") -> DecodeKernel:
    """The linears on released FP8 / MXFP4 / bf16 encodings (blockscaled.cpp) on the
    instruction-set `path` (BLOCKSCALED_PATH_FLAGS), built on the first call in a process
    if the cache lacks it."""
    return _load(
        (BLOCKSCALED_SOURCE,),
        f"block-scaled linear kernel ({path})",
        BLOCKSCALED_PATH_FLAGS[path],
    )


@functools.cache
def load_hyper_connection_kernel() -> DecodeKernel:
    """V4.1's mHC ops (hyper_connection.cpp, registered as torch.ops.deepwell_mhc), built on
    the first call in a process if the cache lacks it."""
    return _load((HYPER_CONNECTION_SOURCE,), "mHC kernel", [], ops="deepwell_mhc")


@functools.cache
def load_cache_rows_kernel() -> DecodeKernel:
    """V4.1's cache row codecs (v41_cache_rows.cpp, registered as
    torch.ops.deepwell_v41_cache), built on the first call in a process if the cache lacks it."""
    return _load((CACHE_ROWS_SOURCE,), "V4.1 cache rows kernel", [], ops="deepwell_v41_cache")


@functools.cache
def load_rotary_kernel() -> DecodeKernel:
    """V4.1's rotary embedding (v41_rotary.cpp, registered as torch.ops.deepwell_v41_rotary),
    built on the first call in a process if the cache lacks it. No fused multiply-adds, so its
    products round as torch's complex multiply does: gcc 12's vectoriser fuses the pairs into
    vfmaddsub even under -ffp-contract=off, so it is off too (a decode step's rows are few)."""
    return _load(
        (ROTARY_SOURCE,),
        "V4.1 rotary kernel",
        ["-ffp-contract=off", "-fno-tree-vectorize"],
        ops="deepwell_v41_rotary",
    )


@functools.cache
def load_sampling_kernel() -> DecodeKernel:
    """The sampler's row scans, top-k / top-p's ranked prefix, the fused top-p draw and the
    inverse CDF (sampling_ops.cpp, registered as torch.ops.deepwell_sampling), built on the
    first call in a process if the cache lacks it. Without fused multiply-adds: its draws
    repeat the torch ops' float32 arithmetic step by step, and a product rounded before its
    difference (as torch rounds it) must not be fused into it."""
    return _load(
        (SAMPLING_SOURCE,), "sampling kernel", ["-ffp-contract=off"], ops="deepwell_sampling"
    )


@functools.cache
def load_invariant_rows_kernel() -> DecodeKernel:
    """The batch-invariant mode's row-wise products (invariant_rows.cpp, registered as
    torch.ops.deepwell_invariant), built on the first call in a process if the cache lacks it."""
    return _load((INVARIANT_ROWS_SOURCE,), "invariant rows kernel", [], ops="deepwell_invariant")


@functools.cache
def load_prefill_kernel() -> DecodeKernel:
    """Prefill chunks' causal attention over the paged cache (prefill_attention.cpp,
    registered as torch.ops.deepwell_prefill), built on the first call in a process if the
    cache lacks it; with its AMX form where amx_tiles_lacking finds no reason against."""
    flags = AMX_FLAGS if amx_tiles_lacking() is None else []
    return _load((PREFILL_SOURCE,), "prefill attention kernel", flags, ops="deepwell_prefill")


@functools.cache
def load_llama_rotary_kernel() -> DecodeKernel:
    """The Llama family's rotary embedding (llama_rotary.cpp, registered as
    torch.ops.deepwell_llama_rotary), built on the first call in a process if the cache lacks
    it; without fused multiply-adds, so it rounds as torch's ops do."""
    return _load(
        (LLAMA_ROTARY_SOURCE,),
        "Llama rotary kernel",
        ["-ffp-contract=off"],
        ops="deepwell_llama_rotary",
    )


@functools.cache
def load_bf16_gemm_kernel() -> DecodeKernel:
    """bf16 linears of decode-shaped steps on AVX512_BF16 (bf16_gemm.cpp, registered as
    torch.ops.deepwell_bf16_gemm), built on the first call in a process if the cache lacks it."""
    return _load((BF16_GEMM_SOURCE,), "bf16 gemm kernel", [], ops="deepwell_bf16_gemm")


def amx_tiles_lacking() -> str | None:
    """Why amx_linear.cpp cannot run its tiles here, or None: the CPU lacks AMX tiles with
    bf16 products, or torch runs below its AVX-512 level (ATEN_CPU_CAPABILITY=avx2, whose
    builds stay on AVX2 paths; an AMX build would not be one)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"no AMX tiles on {platform.machine()}"
    capabilities = torch.cpu.get_capabilities()
    if not (capabilities.get("amx_tile") and capabilities.get("amx_bf16")):
        return "this CPU has no AMX bf16 tiles"
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return f"torch runs at {torch.backends.cpu.get_cpu_capability()}, below AVX-512"
    return None


@functools.cache
def load_amx_linear_kernel() -> DecodeKernel:
    """The batch-invariant mode's bf16 linears on AMX tiles (amx_linear.cpp, registered as
    torch.ops.deepwell_amx_linear), built on the first call in a process if the cache lacks
    it; nothing is compiled where amx_tiles_lacking says why (a missing compiler said first,
    as for every kernel)."""
    lacking = amx_tiles_lacking()
    if lacking is not None and _missing_tool() is None:
        KERNEL_STATES["AMX linear kernel"] = "unavailable"
        return DecodeKernel(None, lacking)
    return _load((AMX_LINEAR_SOURCE,), "AMX linear kernel", AMX_FLAGS, ops="deepwell_amx_linear")


@functools.cache
def load_llama_kernel() -> DecodeKernel:
    """The whole-step Llama decoder with the attention and linear kernels it calls (their
    own Python modules left out: one extension has one), built on the first call in a
    process if the cache lacks it."""
    return _load(LLAMA_SOURCES, "native decode step", ["-DDEEPWELL_ONE_EXTENSION"])


# Every kernel this process has asked for, by what it is: "building" (or loading from the
# cache), "loaded" or "unavailable" (the torch path runs). A worker's heartbeats carry it to
# /metrics, so a start busy compiling shows as such.
KERNEL_STATES: dict[str, str] = {}


def _load(
    sources: tuple[Path, ...], what: str, extra_flags: list[str], ops: str | None = None
) -> DecodeKernel:
    KERNEL_STATES[what] = "building"
    kernel = _build(sources, what, extra_flags, ops)
    KERNEL_STATES[what] = "loaded" if kernel.module is not None else "unavailable"
    return kernel


def _build(
    sources: tuple[Path, ...], what: str, extra_flags: list[str], ops: str | None
) -> DecodeKernel:
    """Builds (or finds) and loads one extension. One with `ops`, the torch.ops namespace its
    sources register, has no Python module to import (pybind11's headers cost its compile a
    third more): the library is loaded for its ops and the module is that namespace."""
    missing = _missing_tool()
    if missing is not None:
        return DecodeKernel(None, missing)
    absent = [path.name for path in (*sources, HEADER) if not path.is_file()]
    if absent:
        # An install that left the C++ sources out (a wheel without its package data).
        return DecodeKernel(None, f"its source is not installed ({', '.join(absent)})")
    from torch.utils.cpp_extension import load

    capability, flags = _vector_flags()
    flags = flags + extra_flags
    try:
        key = _build_key(sources, flags)
    except OSError as error:
        return DecodeKernel(None, f"its source cannot be read ({error})")
    name = f"deepwell_{sources[0].stem}_{capability.lower()}_{key}"
    directory = _build_directory(name)
    if not any(directory.glob(f"{name}*.so")):
        logger.warning(
            "compiling the %s, once, ~%d s (cached in %s)", what, BUILD_SECONDS, directory
        )
    started = time.monotonic()
    try:
        with kernel_build_lock(
            directory, what, wait_seconds=BUILD_WAIT_SECONDS, stale_seconds=BUILD_STALE_SECONDS
        ):
            module = load(
                name,
                _staged_sources(sources, directory),
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=ops is None,
            )
        if ops is not None:
            module = getattr(torch.ops, ops)
    except KernelBuildWaitTimeout as error:
        return DecodeKernel(None, str(error), directory)
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        return DecodeKernel(None, f"its build failed ({first_line}; log in {directory})", directory)
    return DecodeKernel(
        module,
        f"{capability}, loaded in {time.monotonic() - started:.1f} s from {directory}",
        directory,
    )


@dataclass(frozen=True)
class KernelBuild:
    """One kernel `deepwell build-kernels` builds: its name, whether only the tests use it,
    how many sources it compiles (the biggest go first), and its loader."""

    name: str
    test_only: bool
    sources: int
    load: Callable[[], DecodeKernel]


KERNEL_BUILDS = (
    KernelBuild("native decode step", False, len(LLAMA_SOURCES), load_llama_kernel),
    KernelBuild("decode attention", False, 2, load_decode_kernel),
    KernelBuild("quantised linear", False, 1, load_quant_kernel),
    KernelBuild("block-scaled linear", False, 1, load_blockscaled_kernel),
    KernelBuild("mHC", False, 1, load_hyper_connection_kernel),
    KernelBuild("V4.1 cache rows", False, 1, load_cache_rows_kernel),
    KernelBuild("V4.1 rotary", False, 1, load_rotary_kernel),
    KernelBuild("sampling", False, 1, load_sampling_kernel),
    KernelBuild("invariant rows", False, 1, load_invariant_rows_kernel),
    KernelBuild("prefill attention", False, 1, load_prefill_kernel),
    KernelBuild("Llama rotary", False, 1, load_llama_rotary_kernel),
    KernelBuild("bf16 gemm", False, 1, load_bf16_gemm_kernel),
    KernelBuild("AMX linear", False, 1, load_amx_linear_kernel),
    *(
        KernelBuild(
            f"quantised linear ({path}, forced)",
            True,
            1,
            functools.partial(load_quant_kernel, path),
        )
        for path in QUANT_PATH_FLAGS
        if path != "native"
    ),
    *(
        KernelBuild(
            f"block-scaled linear ({path}, forced)",
            True,
            1,
            functools.partial(load_blockscaled_kernel, path),
        )
        for path in BLOCKSCALED_PATH_FLAGS
        if path != "native"
    ),
)


def build_kernels(
    builds: Sequence[KernelBuild],
    jobs: int,
    report: Callable[[KernelBuild, DecodeKernel, float], None],
) -> dict[str, DecodeKernel]:
    """Builds (or loads from the cache) each kernel, `jobs` at a time, one compiler process
    each, biggest first; `report` hears of each as it ends, with its wall seconds."""
    # One compile per build at a time, so `jobs` bounds the compilers (each ~1.4 GB) too.
    os.environ["MAX_JOBS"] = "1"
    _missing_tool()  # puts ninja on PATH once, before the threads read it

    def build(kernel: KernelBuild) -> tuple[KernelBuild, DecodeKernel, float]:
        started = time.monotonic()
        return kernel, kernel.load(), time.monotonic() - started

    ordered = sorted(builds, key=lambda kernel: -kernel.sources)
    results: dict[str, DecodeKernel] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for future in concurrent.futures.as_completed([pool.submit(build, k) for k in ordered]):
            kernel, loaded, seconds = future.result()
            results[kernel.name] = loaded
            report(kernel, loaded, seconds)
    return results
