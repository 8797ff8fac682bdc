"""Bind a mapped V4.1 checkpoint (checkpoint.py) to a model built on the meta device.

Packed (the default), every weight keeps its released encoding: an FP8-block linear becomes
an Fp8BlockLinear, each MoE's routed experts one MxFp4Experts bank, the Engram tables
Fp8RowEmbeddings, bf16 linears Bf16Linears (packed_modules.py), all over the mapped bytes;
large bf16 tensors are bound without a copy where the model's dtype is theirs. Expanded
(EngineArgs.expand_weights), each weight is dequantised to the model's dtype as it is bound,
one tensor at a time, into today's nn.Linear and per-expert modules: the reference path.
Small tensors (norms, mHC, router, sinks) become float32 either way, as the model keeps them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.layers.blockscaled import MxFp4Experts
from deepwell.engine.models.deepseek_v41.checkpoint import dequantized
from deepwell.engine.models.deepseek_v41.moe import MoE
from deepwell.engine.models.deepseek_v41.packed_modules import (
    Bf16Linear,
    Fp8BlockLinear,
    Fp8RowEmbedding,
)
from deepwell.engine.models.deepseek_v41.schema import TensorSpec
from deepwell.engine.models.deepseek_v41.weight_formats import WeightFormat

# A routed expert's projection or a fused projection's half, by our module names.
_ROUTED = re.compile(r"^(.+\.ffn)\.experts\.(\d+)\.(w[123])(?:\.weight)?$")
_HALF = re.compile(r"^(.+)\.(w[13])$")


@dataclass(frozen=True)
class Released:
    """One released tensor as mapped: its spec, stored weight and scale (None: plain)."""

    spec: TensorSpec
    weight: torch.Tensor
    scale: torch.Tensor | None


def bind_weights(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    schema: Mapping[str, TensorSpec],
    targets: Callable[[str], list[str]],
    dtype: torch.dtype,
    expand: bool,
) -> None:
    """Bind every tensor of `schema` found in `tensors` to `targets(released name)` (our
    parameter names; w1/w3 as their halves). Every meta parameter must be replaced."""
    halves: dict[str, dict[str, Released]] = {}
    banks: dict[str, dict[int, dict[str, Released]]] = {}
    for spec in schema.values():
        if spec.name not in tensors:
            continue  # another rank's expert, or a draft stage the model does not build
        released = Released(
            spec, tensors[spec.name], None if spec.scale_name is None else tensors[spec.scale_name]
        )
        for name in targets(spec.name):
            routed = _ROUTED.match(name)
            if routed is not None and not expand:
                moe, slot, projection = routed.groups()
                banks.setdefault(moe, {}).setdefault(int(slot), {})[projection] = released
                continue
            half = _HALF.match(name)
            if half is not None:
                halves.setdefault(half.group(1), {})[half.group(2)] = released
                continue
            _bind_one(model, name, released, dtype, expand)
    for prefix, parts in halves.items():
        if set(parts) != {"w1", "w3"}:
            raise ModelLoadError(f"checkpoint has only {sorted(parts)} of {prefix}.w1/w3")
        _bind_fused(model, f"{prefix}.w13", (parts["w1"], parts["w3"]), dtype, expand)
    for prefix, slots in banks.items():
        _bind_bank(model.get_submodule(prefix), prefix, slots)
    for module in model.modules():
        if isinstance(module, MoE):
            module.input_dtype = dtype
    unset = [name for name, p in model.named_parameters() if p.is_meta]
    if unset:
        raise ModelLoadError(f"checkpoint lacks tensors for: {sorted(unset)[:5]}")


def _bind_one(
    model: nn.Module, name: str, released: Released, dtype: torch.dtype, expand: bool
) -> None:
    path, attribute = name.rsplit(".", 1)
    try:
        module = model.get_submodule(path)
    except AttributeError:
        module = None
    target = getattr(module, attribute, None)
    if module is None or not isinstance(target, nn.Parameter):
        raise ModelLoadError(f"checkpoint tensor {released.spec.name!r} has no place in the model")
    _check_shape(released, tuple(target.shape))
    spec = released.spec
    is_matrix = isinstance(module, nn.Linear | nn.Embedding) and attribute == "weight"
    if is_matrix and not expand:
        packed = _packed_module(module, path, released, dtype)
        if packed is not None:
            _replace(model, path, packed)
            return
    # The head computes in float32 (the reference's), like every tensor outside the matrices.
    wanted = dtype if is_matrix and path != "head" else torch.float32
    # .to keeps the mapped view itself when the dtype is already the wanted one.
    value = _dense(released, wanted) if spec.format.quantized else released.weight.to(wanted)
    setattr(module, attribute, nn.Parameter(value, requires_grad=False))


def _packed_module(
    module: nn.Module, path: str, released: Released, dtype: torch.dtype
) -> nn.Module | None:
    """The packed module in place of `module`, or None where the plain one is kept."""
    fmt = released.spec.format
    if fmt is WeightFormat.FP8_BLOCKS and isinstance(module, nn.Linear):
        return Fp8BlockLinear([(released.weight, released.scale)])
    if fmt is WeightFormat.FP8_ROWS and isinstance(module, nn.Embedding):
        return Fp8RowEmbedding(released.weight, released.scale, dtype)
    stored = released.weight.dtype
    if isinstance(module, nn.Linear) and stored == torch.bfloat16:
        # The head and Markov heads: float32 products straight from the bf16 weights.
        return Bf16Linear(released.weight)
    if fmt.quantized:
        raise ModelLoadError(
            f"{released.spec.name!r} is {fmt.value}, which {path} ({type(module).__name__}) "
            "cannot hold packed"
        )
    return None


def _bind_fused(
    model: nn.Module,
    name: str,
    parts: tuple[Released, Released],
    dtype: torch.dtype,
    expand: bool,
) -> None:
    """A gate/up pair into one fused linear, gate rows first."""
    module = model.get_submodule(name)
    for part in parts:
        _check_shape(part, (module.out_features // 2, module.in_features))
    if not expand and all(part.spec.format is WeightFormat.FP8_BLOCKS for part in parts):
        _replace(model, name, Fp8BlockLinear([(part.weight, part.scale) for part in parts]))
        return
    value = torch.cat([_dense(part, dtype) for part in parts])
    module.weight = nn.Parameter(value, requires_grad=False)


def _bind_bank(moe: MoE, prefix: str, slots: dict[int, dict[str, Released]]) -> None:
    """One layer's routed experts as one MXFP4 bank, slot by slot."""
    expected = moe.num_slots
    if sorted(slots) != list(range(expected)) or any(len(p) != 3 for p in slots.values()):
        raise ModelLoadError(f"checkpoint lacks routed experts of {prefix} (w1, w3, w2 each)")
    hidden, inter = moe.hidden_size, moe.intermediate_size
    columns: dict[str, list[torch.Tensor]] = {}
    for slot in range(expected):
        for projection, shape in (
            ("w1", (inter, hidden)),
            ("w3", (inter, hidden)),
            ("w2", (hidden, inter)),
        ):
            released = slots[slot][projection]
            _check_shape(released, shape)
            if released.spec.format is not WeightFormat.MXFP4:
                raise ModelLoadError(f"{released.spec.name!r} should be MXFP4 to join a bank")
            columns.setdefault(projection, []).append(released.weight)
            columns.setdefault(f"{projection}_scale", []).append(released.scale)
    moe.hold_packed_experts(MxFp4Experts.from_tensors(**columns))


def _dense(released: Released, dtype: torch.dtype) -> torch.Tensor:
    spec = released.spec
    tensors = {spec.name: released.weight}
    if spec.scale_name is not None:
        tensors[spec.scale_name] = released.scale
    return dequantized(tensors, spec, dtype)


def _check_shape(released: Released, expected: tuple[int, ...]) -> None:
    if tuple(released.spec.shape) != tuple(expected):
        raise ModelLoadError(
            f"checkpoint tensor {released.spec.name!r} has shape {list(released.spec.shape)}, "
            f"the model expects {list(expected)}"
        )


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
