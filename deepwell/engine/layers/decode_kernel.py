"""Builds and loads the C++ decode kernels (paged_decode.cpp: paged attention, with
llama_glue.cpp's fused norms and activations beside it; quant_gemv.cpp:
GGUF-block linears; llama_decode.cpp: a whole Llama decode step, compiled with the other two
into one extension; blockscaled.cpp: linears on DeepSeek-V4.1's FP8 / MXFP4 / bf16 weights):
compiled once per machine into the torch extensions cache on first use,
loaded from there after.

Nothing here runs at import: only an engine that decodes asks for a kernel, so commands
that never decode never compile. The build uses the local C++ compiler and ninja only; it
downloads nothing.
"""

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.cpp")
# Rides in the attention extension, which the C++ backend builds anyway: no extra build.
GLUE_SOURCE = Path(__file__).with_name("llama_glue.cpp")
QUANT_SOURCE = Path(__file__).with_name("quant_gemv.cpp")
LLAMA_SOURCES = (Path(__file__).with_name("llama_decode.cpp"), SOURCE, QUANT_SOURCE)
BLOCKSCALED_SOURCE = Path(__file__).with_name("blockscaled.cpp")
# What the sources share: its changes must change every build key.
HEADER = Path(__file__).with_name("kernel_parts.h")
# A cold build on a 2-core machine (gcc 12, torch 2.13 headers): what the log line quotes.
BUILD_SECONDS = 60
# quant_gemv.cpp's instruction-set paths: "native" takes the best this CPU has; the others
# force a lower one (the tests build each to keep them all checked).
QUANT_PATH_DEFINES = {
    "native": [],
    "avx2": ["-DDEEPWELL_QUANT_AVX2"],
    "scalar": ["-DDEEPWELL_QUANT_SCALAR"],
}

# blockscaled.cpp's instruction-set paths, alike: AVX-512 at best, forced AVX2, scalar.
BLOCKSCALED_PATH_DEFINES = {
    "native": [],
    "avx2": ["-DDEEPWELL_BLOCKSCALED_AVX2"],
    "scalar": ["-DDEEPWELL_BLOCKSCALED_SCALAR"],
}


@dataclass(frozen=True)
class DecodeKernel:
    """The loaded extension, or None with the reason it is not there."""

    module: ModuleType | None
    reason: str


def _vector_flags() -> tuple[str, list[str]]:
    """The ATen vector width to compile for (torch's own dispatch level on this CPU), and the
    compiler flags for it. -march=native lets the compiler use every instruction this CPU
    has, so the build is keyed by the CPU (`_build_name`)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
    # ATen's Vectorized<float> uses intrinsics only under these macros (else plain arrays).
    level = {"AVX512": "AVX512", "AVX2": "AVX2"}.get(capability)
    if level is not None:
        flags += [f"-DCPU_CAPABILITY={level}", f"-DCPU_CAPABILITY_{level}"]
    return capability, flags


def _build_key(sources: tuple[Path, ...], flags: list[str]) -> str:
    """A digest of the sources and their header, the flags, torch's version and the CPU's
    model and features: a build made with -march=native for one CPU must not load on another
    sharing the same home directory, and a changed source is a new build (announced as one).
    The sources' folder is part of it too: torch's build file names each source by its path,
    so two checkouts sharing one build folder rebuilt it every time the other had used it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = [platform.processor()]
    wanted = ("model name", "flags", "Features", "CPU part")
    described = sorted({line for line in lines if line.startswith(wanted)})
    texts = [path.read_text() for path in (*sources, HEADER)]
    parts = [str(sources[0].parent), *texts, *flags, torch.__version__, platform.machine()]
    parts += described
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def _build_directory(name: str) -> Path:
    """torch's extensions cache (TORCH_EXTENSIONS_DIR, else under ~/.cache), one folder per
    build key."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


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
    (QUANT_PATH_DEFINES), built on the first call in a process if the cache lacks it."""
    return _load((QUANT_SOURCE,), f"quantised linear kernel ({path})", QUANT_PATH_DEFINES[path])


@functools.cache
def load_blockscaled_kernel(path: str = "native") -> DecodeKernel:
    """The linears on released FP8 / MXFP4 / bf16 encodings (blockscaled.cpp) on the
    instruction-set `path` (BLOCKSCALED_PATH_DEFINES), built on the first call in a process
    if the cache lacks it."""
    return _load(
        (BLOCKSCALED_SOURCE,),
        f"block-scaled linear kernel ({path})",
        BLOCKSCALED_PATH_DEFINES[path],
    )


@functools.cache
def load_llama_kernel() -> DecodeKernel:
    """The whole-step Llama decoder with the attention and linear kernels it calls (their
    own Python modules left out: one extension has one), built on the first call in a
    process if the cache lacks it."""
    return _load(LLAMA_SOURCES, "native decode step", ["-DDEEPWELL_ONE_EXTENSION"])


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One build per directory at a time, under a lock the kernel drops when its holder
    dies. torch's own `lock` file outlives a build that was killed (a timeout, Ctrl-C), and
    every later process would wait on it forever; holding this lock, no live process can be
    building here, so a `lock` file left behind is stale and goes."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "deepwell.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load(sources: tuple[Path, ...], what: str, defines: list[str]) -> DecodeKernel:
    missing = _missing_tool()
    if missing is not None:
        return DecodeKernel(None, missing)
    absent = [path.name for path in (*sources, HEADER) if not path.is_file()]
    if absent:
        # An install that left the C++ sources out (a wheel without its package data).
        return DecodeKernel(None, f"its source is not installed ({', '.join(absent)})")
    from torch.utils.cpp_extension import load

    capability, flags = _vector_flags()
    flags = flags + defines
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
        with _build_lock(directory):
            module = load(
                name,
                [str(source) for source in sources],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
            )
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        return DecodeKernel(None, f"its build failed ({first_line}; log in {directory})")
    return DecodeKernel(
        module, f"{capability}, loaded in {time.monotonic() - started:.1f} s from {directory}"
    )
