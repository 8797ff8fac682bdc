"""Engine X's Triton kernels, one module per kernel beside its CPU counterpart; this module
answers whether Triton is there to run them (`require_triton`)."""

import importlib
from types import ModuleType


class KernelSetError(ValueError):
    """The Triton kernel set was asked for and cannot run."""


def require_triton() -> ModuleType:
    """The triton module, or a KernelSetError saying how to get it: a kernel set that was
    asked for never falls back silently."""
    try:
        return importlib.import_module("triton")
    except ImportError as error:
        raise KernelSetError(
            f"--kernels triton needs Triton ({error}): pip install triton==3.9.0, "
            "or run with --kernels auto"
        ) from None
