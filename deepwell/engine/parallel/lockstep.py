"""The expert-parallel ranks' lock step: every `step()` of every rank agrees, by an all-reduce
of (has work, has unfinished) flags, whether the group computes; an idle rank then joins
each MoE layer's all-to-all with zero tokens (a dummy step), and EPLB re-places at step ends."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from deepwell.engine.parallel.eplb import EplbState, rebalance
from deepwell.engine.parallel.group import DistributedGroup, collective

# A group with nothing to do ticks this often (each tick is an all-reduce of two flags).
IDLE_TICK_S = 0.002


class StepGate:
    def __init__(
        self, group: DistributedGroup, moe_layers: list[nn.Module], eplb: EplbState | None
    ) -> None:
        self.group = group
        # In forward order: a dummy step runs them in the order a real one meets them.
        self.moe_layers = moe_layers
        self.eplb = eplb
        # Steps the group computed (the same count on every rank).
        self.steps = 0
        # Whether any rank had unfinished requests at the last agreement.
        self.group_unfinished = True

    def agree(self, has_work: bool, has_unfinished: bool) -> bool:
        """Called once per `step()` by every rank; True when any rank computes this step."""
        flags = torch.tensor([int(has_work), int(has_unfinished)], device=self.group.device)
        with collective(self.group, "step agreement"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        any_work, self.group_unfinished = bool(flags[0]), bool(flags[1])
        if not any_work:
            if not self.group_unfinished:
                time.sleep(IDLE_TICK_S)
            return False
        eplb = self.eplb
        if eplb is not None:
            if eplb.rebalances_at(self.steps):
                eplb.history.append(
                    rebalance(self.moe_layers, self.group, self.steps, eplb.min_gain)
                )
            elif eplb.window_opens_at(self.steps):
                for moe in self.moe_layers:
                    moe.parallel.expert_tokens.zero_()
        self.steps += 1
        return True

    @torch.inference_mode()
    def dummy_step(self) -> None:
        """This rank's part of a step it has no tokens for: each MoE layer's exchange."""
        for moe in self.moe_layers:
            moe(torch.zeros(0, moe.hidden_size, dtype=moe.input_dtype, device=self.group.device))
