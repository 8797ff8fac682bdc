"""The Triton kernel set (`--kernels triton`): one module per kernel, each beside its torch reference.

Kernels import Triton through `require_triton()` (an error, never a silent fallback, when it is missing)
and the engine names the kernel set it runs once through `log_kernel_set`; TRITON_INTERPRET=1 runs them
on CPU tensors.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

from deepwell.engine.errors import EngineError

logger = logging.getLogger(__name__)

# The version pyproject.toml pins; the kernels are tested against its interpreter.
TRITON_PIN = "triton==3.9.0"


class KernelSetError(EngineError, ValueError):
    """The asked-for kernel set cannot run here (Triton missing)."""


def require_triton() -> ModuleType:
    """The `triton` module, or KernelSetError saying how to get it or how to do without."""
    try:
        return importlib.import_module("triton")
    except ImportError as error:
        raise KernelSetError(
            f"--kernels triton needs Triton, which is not importable here ({error}); "
            f"`pip install {TRITON_PIN}` or use `--kernels auto`"
        ) from None


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (on CPU tensors) instead of a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def log_kernel_set(kernels: str, device_type: str = "cpu") -> None:
    """Says once per engine which kernel set runs, so no fallback goes unnoticed; refuses the
    Triton set where it cannot run (Triton missing, or CPU tensors without the interpreter)."""
    if kernels == "triton":
        require_triton()
        if device_type == "cpu" and not interpreting():
            raise KernelSetError(
                "--kernels triton on the CPU runs only in Triton's interpreter: set "
                "TRITON_INTERPRET=1 (slow; for checks), use --device cuda, or --kernels auto"
            )
        where = "Triton interpreter on CPU" if interpreting() else "compiled"
        logger.info("kernel set: triton (%s)", where)
    else:
        logger.info("kernel set: auto (native C++ where it builds, else torch)")
