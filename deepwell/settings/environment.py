"""The registry of deepwell's environment variables: each DEEPWELL_* name, what it sets and
how its text is read. Every read goes through `read`, so an unregistered name is an error
and `docs` can list them all from here. Variables other tools define (torchrun's RANK, the
compiler's CXX) are declared too (`register_foreign`), so that every name deepwell reads
is listed here (tests/settings/test_environment_reads.py scans for the rest).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    name: str
    # What it sets (a setting's name, or a sentence).
    sets: str
    # The value of a set, non-empty text; raises ValueError naming the variable.
    parse: Callable[[str], Any]
    # The value when it is unset, and words for it where the value says too little.
    default: Any = None
    default_text: str | None = None


_REGISTRY: dict[str, EnvVar] = {}
# Other tools' variables deepwell reads: name → whose it is and why deepwell reads it.
_FOREIGN: dict[str, str] = {}


def register(
    name: str,
    sets: str,
    parse: Callable[[str], Any],
    default: Any = None,
    default_text: str | None = None,
) -> str:
    """Declare a variable once; returns its name, for the declaration that uses it."""
    if not name.startswith("DEEPWELL_"):
        raise ValueError(f"deepwell's environment variables start with DEEPWELL_, got {name}")
    if name in _REGISTRY:
        raise ValueError(f"{name} is declared twice ({_REGISTRY[name].sets} and {sets})")
    _REGISTRY[name] = EnvVar(name, sets, parse, default, default_text)
    return name


def register_foreign(name: str, owner: str) -> str:
    """Declare another tool's variable that deepwell reads as that tool defines it."""
    if name.startswith("DEEPWELL_"):
        raise ValueError(f"{name} is deepwell's own: declare it with register")
    _FOREIGN[name] = owner
    return name


def registered() -> dict[str, EnvVar]:
    return dict(_REGISTRY)


def foreign() -> dict[str, str]:
    return dict(_FOREIGN)


def read(name: str, environ: Mapping[str, str] = os.environ) -> Any | None:
    """The variable's parsed value; None when it is unset, or empty and not a switch (an
    empty switch is off, as DeepInfer reads it)."""
    variable = _REGISTRY[name]
    text = environ.get(name)
    if not text:
        return False if text == "" and variable.parse is parse_flag else None
    try:
        return variable.parse(text)
    except ValueError as error:
        raise ValueError(f"{name} {error}") from None


# --- how their text is read ---


def parse_flag(text: str) -> bool:
    """DeepInfer's reading of a switch: on unless "0", "", "false" or "False"."""
    return text not in ("0", "", "false", "False")


def parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"must be an integer, got {text!r}") from None


def parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"must be a number, got {text!r}") from None


def parse_token_ids(text: str) -> tuple[int, ...]:
    """Comma-separated token ids (DeepInfer's DECODE_TOKEN_BLACKLIST)."""
    try:
        ids = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"must be comma-separated token ids, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise ValueError(f"token ids must be >= 0, got {text!r}")
    return ids


def parse_floats(text: str) -> tuple[float, ...]:
    """A float or a comma-separated list of floats (DeepInfer's per-position switches)."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"must be a float or a comma list of floats, got {text!r}") from None


def parse_text(text: str) -> str:
    return text


# --- other tools' variables, read as they define them ---

for _name, _owner in {
    "RANK": "torchrun: this process's global rank (ParallelConfig.from_torchrun)",
    "WORLD_SIZE": "torchrun: the number of ranks",
    "MASTER_ADDR": "torchrun / torch.distributed: where the ranks meet",
    "MASTER_PORT": "torchrun / torch.distributed: its port",
    "GROUP_RANK": "torchrun: this machine's index",
    "NNODES": "torchrun: the number of machines",
    "TORCH_EXTENSIONS_DIR": "torch: where the C++ kernels are built and cached",
    "PATH": "the shell: ninja is looked for on it (C++ kernel builds)",
    "CXX": "the C++ compiler the kernels build with",
    "MAX_JOBS": "torch's C++ extension builds: compiler processes per build (set to 1 by "
    "deepwell build-kernels, which runs builds side by side instead)",
    "TRITON_INTERPRET": "Triton: run the Triton kernels on the CPU",
    "ONEDNN_MAX_CPU_ISA": "oneDNN: the highest instruction set it may use; below AMX the bf16 "
    "linears leave amx_linear.cpp's tiles for oneDNN, and their decode-sized calls take the "
    "panel kernel (layers/bf16_gemm.py)",
    "DNNL_MAX_CPU_ISA": "oneDNN: ONEDNN_MAX_CPU_ISA's older name",
    "ATEN_CPU_CAPABILITY": "torch: the highest instruction set its CPU kernels use; below "
    "avx512, `--dtype auto` is float32 (cpu_dtype.py)",
    # Models by name (settings/model_source.py), read as huggingface_hub reads them.
    "HF_HUB_OFFLINE": "huggingface_hub: never download; a model by name comes from the cache",
    "HF_HUB_CACHE": "huggingface_hub: the cache models by name are fetched into",
    "HF_HOME": "huggingface_hub: its home; the cache is HF_HOME/hub unless HF_HUB_CACHE is set",
    "HF_ENDPOINT": "huggingface_hub: the hub's address (a mirror)",
}.items():
    register_foreign(_name, _owner)


# --- test hooks: set only by tests, never in service (serve/worker_test_hooks.py) ---

WORKER_EXIT_ON_PROMPT_ENV = register(
    "DEEPWELL_TEST_WORKER_EXIT_ON_PROMPT",
    "test hook, never set in service: an engine worker exits at once (os._exit, as a crash "
    "would) when it is sent a request whose prompt holds this text",
    parse_text,
)
WORKER_RAISE_ON_PROMPT_ENV = register(
    "DEEPWELL_TEST_WORKER_RAISE_ON_PROMPT",
    "test hook, never set in service: an engine worker's step raises RuntimeError while a "
    "request whose prompt holds this text is in the engine",
    parse_text,
)
