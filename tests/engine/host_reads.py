"""Counting host synchronisations without a GPU: every torch call from deepwell code that reads
a tensor's values on the host (`.tolist()`, `.item()`, `bool(t)`, `nonzero` ...) would wait for
the device on CUDA, so a TorchFunctionMode records where deepwell makes one."""

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import deepwell

# Calls whose result is host data, or whose output size depends on values (CUDA then waits).
HOST_READS = {
    "tolist",
    "item",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "unique",
    "unique_consecutive",
    "masked_select",
    "bincount",
    "numpy",
    "cpu",
}
PACKAGE = str(Path(deepwell.__file__).parent)
TORCH = str(Path(torch.__file__).parent)


class HostReads(TorchFunctionMode):
    """Within the block: (file:line, call) → how often deepwell code read values on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[tuple[str, str]] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS or _sized_by_values(name, args, kwargs or {}):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(PACKAGE):
                where = f"{Path(frame.f_code.co_filename).relative_to(PACKAGE)}:{frame.f_lineno}"
                self.reads[(where, name)] += 1
        return func(*args, **(kwargs or {}))


def _sized_by_values(name: str, args: tuple, kwargs: dict) -> bool:
    """repeat_interleave with per-element repeats and no output_size: its size is their sum."""
    if name != "repeat_interleave" or "output_size" in kwargs:
        return False
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    return isinstance(repeats, torch.Tensor) and repeats.numel() > 1
