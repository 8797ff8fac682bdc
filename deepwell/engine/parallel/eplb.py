"""EPLB: count tokens per expert over a window of steps, every interval of steps re-place the
experts of every MoE layer from the window's all-reduced counts, and move expert weights between ranks to match, for the
layers where that lowers the load's imbalance enough to be worth the move."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from deepwell.engine.layers.batch_invariant import AmxTileLinear
from deepwell.engine.layers.blockscaled import MxFp4Experts
from deepwell.engine.layers.packed_linear import repack
from deepwell.engine.parallel.group import DistributedGroup, collective
from deepwell.engine.parallel.placement import (
    ExpertPlacement,
    balanced_placement,
    imbalance,
    worth_moving,
)


@dataclass(frozen=True)
class Rebalance:
    """One re-placement: the window's max/mean rank load under the old placement and,
    for the same tokens, under the new one (summed over layers)."""

    step: int
    imbalance_before: float
    imbalance_after: float
    moved_experts: int


@dataclass
class EplbState:
    # The counts behind a re-placement are those of its last `window_steps` steps.
    window_steps: int
    # ParallelConfig.eplb_min_gain.
    min_gain: float
    # Steps between re-placements, at least the window (DeepInfer's
    # EXPERT_REARRANGEMENT_STEP_INTERVAL beside its EXPERT_COUNT_WINDOW_SIZE).
    interval_steps: int
    history: list[Rebalance] = field(default_factory=list)

    def rebalances_at(self, step: int) -> bool:
        return step > 0 and step % self.interval_steps == 0

    def window_opens_at(self, step: int) -> bool:
        """Whether the counts restart at this step: `window_steps` before a re-placement
        (the re-placement itself restarts them, so a window as long as the interval never
        needs this)."""
        return (step + self.window_steps) % self.interval_steps == 0 and (
            self.window_steps < self.interval_steps
        )


def rebalance(
    moe_layers: list[nn.Module], group: DistributedGroup, step: int, min_gain: float
) -> Rebalance:
    """Re-place each layer's experts by its window's load where that lowers the layer's
    max/mean rank load by `min_gain` or more; the same result on every rank, which must all
    call this at the same step boundary."""
    loads = torch.stack([moe.parallel.expert_tokens for moe in moe_layers])
    with collective(group, "EPLB load all-reduce"):
        dist.all_reduce(loads)
    before = [0.0] * group.world_size
    after = [0.0] * group.world_size
    moved = 0
    for moe, layer_loads in zip(moe_layers, loads.tolist(), strict=True):
        old = moe.parallel.placement
        new = balanced_placement(layer_loads, old.num_ranks, len(old.slot_experts))
        if not worth_moving(layer_loads, old, new, min_gain):
            new = old
        for totals, placement in ((before, old), (after, new)):
            for rank, load in enumerate(placement.rank_loads(layer_loads)):
                totals[rank] += load
        if new != old:
            moved += _move_experts(moe, old, new, group)
            moe.parallel.set_placement(new)
        moe.parallel.expert_tokens.zero_()
    return Rebalance(step, imbalance(before), imbalance(after), moved)


def _move_experts(
    moe: nn.Module, old: ExpertPlacement, new: ExpertPlacement, group: DistributedGroup
) -> int:
    """Give this rank's slots their new experts' weights: a copy where the rank held the
    expert already, else sent by the lowest rank that held it (every rank derives the same
    transfer list, so sends and receives pair up). Returns the transfers of the group."""
    rank = group.rank
    transfers = []  # (destination rank, its local slot, source rank, source local slot)
    for dst in range(new.num_ranks):
        had = old.rank_experts(dst)
        for slot, expert in enumerate(new.rank_experts(dst)):
            if expert not in had:
                src_slot = old.slot_experts.index(expert)
                transfers.append((dst, slot, *divmod(src_slot, old.slots_per_rank)))
    slots = _slot_tensors(moe)
    parts = len(slots[0])
    had = old.rank_experts(rank)
    # New weights first, from the old ones, so no slot is overwritten before it is read.
    weights = [
        [w.detach().clone() for w in slots[had.index(expert)]]
        if expert in had
        else [torch.empty_like(w) for w in slots[slot]]
        for slot, expert in enumerate(new.rank_experts(rank))
    ]
    pending = []
    with collective(group, "EPLB expert move"):
        for tag, (dst, slot, src, src_slot) in enumerate(transfers):
            for part, tensor in enumerate(slots[src_slot] if src == rank else ()):
                wire = _on_the_wire(tensor.detach().contiguous())
                pending.append(dist.isend(wire, dst, tag=parts * tag + part))
            if dst == rank:
                for part, tensor in enumerate(weights[slot]):
                    pending.append(dist.irecv(_on_the_wire(tensor), src, tag=parts * tag + part))
        for request in pending:
            request.wait()
    if getattr(moe, "packed_experts", None) is not None:
        # The bank is immutable: the moved tensors make a new one.
        moe.hold_packed_experts(MxFp4Experts.from_tensors(*zip(*weights, strict=True)))
        return len(transfers)
    for expert_module, tensors in zip(moe.experts, weights, strict=True):
        for linear, tensor in zip((expert_module.w13, expert_module.w2), tensors, strict=True):
            linear.weight.data.copy_(tensor)
            if hasattr(linear, "packed_weight"):  # packed bf16 (layers/packed_linear.py)
                repack(linear)
            elif isinstance(linear, AmxTileLinear):  # batch-invariant, on AMX tiles
                linear.retile()
    return len(transfers)


def _slot_tensors(moe: nn.Module) -> list[list[torch.Tensor]]:
    """Each local slot's expert weights: an MXFP4 bank's codes and scales (kept as
    released), or the expanded modules' fused w13 and w2."""
    bank = getattr(moe, "packed_experts", None)
    if bank is not None:
        columns = (bank.w1, bank.w1_scale, bank.w3, bank.w3_scale, bank.w2, bank.w2_scale)
        return [list(slot) for slot in zip(*columns, strict=True)]
    return [[expert.w13.weight, expert.w2.weight] for expert in moe.experts]


def _on_the_wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as gloo can send it: one-byte float formats (FP8, E8M0) as their bytes."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor
