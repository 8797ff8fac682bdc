"""Where the engine computes: `--device` resolved to a torch.device, and the one function
that puts a step's host-built tensors there (pinned, asynchronous copies on CUDA).

The runner builds a step's metadata on the host (lists of ints from the scheduler) and hands it
to `place`, so no per-step tensor is left on the CPU when the engine runs on CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
from array import array
from typing import TypeVar

import torch

from deepwell.engine.errors import EngineError

T = TypeVar("T")

# Where a step is built (from the scheduler's Python lists) before `place` moves it.
HOST = torch.device("cpu")


def on_host() -> contextlib.AbstractContextManager:
    """A context in which tensors built without a device land on the host. A device context
    intercepts every torch call made in it (~60 µs of a batch-1 decode step's ~0.3 ms of
    preparation), so it is entered only where the default device is not the host already."""
    return contextlib.nullcontext() if torch.get_default_device() == HOST else HOST


class DeviceError(EngineError, ValueError):
    """The asked-for device is not there (no CUDA in this torch build, or no GPU visible)."""


def resolve_device(choice: str) -> torch.device:
    """`--device`: "cpu", "cuda" (an error naming what is missing where CUDA is not
    usable) or "auto" (CUDA when torch sees a GPU, else the CPU)."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        missing = (
            f"this torch ({torch.__version__}) is built without CUDA"
            if torch.version.cuda is None
            else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
        )
        raise DeviceError(f"--device cuda: {missing}; use --device cpu or --device auto")
    return torch.device(choice)


def memory_budget_gib(memory_gib: float, gpu_memory_utilization: float, device: torch.device):
    """The budget the planner fits weights and KV cache in: `--memory-gib` on the CPU (a
    ceiling shared with the host), a share of the GPU's own memory on CUDA."""
    if device.type != "cuda":
        return memory_gib
    total = torch.cuda.get_device_properties(device).total_memory
    return total * gpu_memory_utilization / 2**30


def long_tensor(values: list[int]) -> torch.Tensor:
    """`torch.tensor(values, dtype=torch.long)` on the host, ~3x faster for a step's lists of
    a thousand block ids (18 against 63 µs): `torch.tensor` reads a list an element at a
    time, `array` converts it in C and the tensor takes the array's buffer without a copy."""
    if not values:
        # frombuffer refuses an empty buffer.
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.long)


def place(value: T, device: torch.device) -> T:
    """`value` with every tensor in it on `device`: a tensor, or dataclasses, lists, tuples
    and dicts holding tensors (the step metadata), copied field by field; anything else as is.
    Host tensors bound for CUDA go through pinned memory, without waiting for the copy."""
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        if device.type == "cuda" and value.device.type == "cpu":
            return value.pin_memory().to(device, non_blocking=True)
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: place(getattr(value, f.name), device)
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, list):
        return [place(item, device) for item in value]
    if isinstance(value, tuple):
        return tuple(place(item, device) for item in value)
    if isinstance(value, dict):
        return {key: place(item, device) for key, item in value.items()}
    return value
