"""One MoE layer's token exchange across expert-parallel ranks: each (row, expert) pair goes
to a rank holding a replica of its expert, is computed there, and comes back (all-to-all)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepwell.engine.parallel.group import DistributedGroup, collective
from deepwell.engine.parallel.placement import ExpertPlacement

# (rows [m, hidden], local slot of each row [m], routing weight of each row [m] float32)
# → the weighted expert outputs [m, hidden], in the rows' order.
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertParallel:
    """A layer's placement tables and its dispatch / combine; counts tokens per expert for EPLB."""

    def __init__(self, group: DistributedGroup, placement: ExpertPlacement) -> None:
        self.group = group
        self.set_placement(placement)
        # Pairs routed to each logical expert by this rank since EPLB last read them.
        self.expert_tokens = torch.zeros(placement.num_experts, dtype=torch.int64)
        # Pairs this rank computed for all ranks (its real load), likewise.
        self.computed_tokens = 0
        # Seconds spent in this layer's all-to-alls (waiting for peers included).
        self.exchange_s = 0.0

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Swap the routing tables in one assignment, between steps."""
        replicas = placement.replicas()
        width = max(len(slots) for slots in replicas)
        table = torch.tensor([slots + slots[:1] * (width - len(slots)) for slots in replicas])
        copies = torch.tensor([len(slots) for slots in replicas])
        self._tables = (placement, table, copies)

    @property
    def placement(self) -> ExpertPlacement:
        return self._tables[0]

    def exchange(
        self,
        x: torch.Tensor,
        experts: torch.Tensor,
        rows: torch.Tensor,
        weights: torch.Tensor,
        local: LocalExperts,
    ) -> torch.Tensor:
        """Routed outputs [pairs, hidden] (x's dtype) of the pairs (`experts`, `rows`,
        `weights`, sorted by expert, rows ascending within one), in that order.

        A replicated expert's pairs take its replicas in turn, the j-th pair of this rank
        the ((j + rank) mod copies)-th replica: deterministic, and ranks start apart.
        """
        placement, table, copies = self._tables
        rank, world = self.group.rank, self.group.world_size
        per_rank = placement.slots_per_rank
        per_expert = torch.bincount(experts, minlength=placement.num_experts)
        self.expert_tokens += per_expert
        first = torch.cumsum(per_expert, 0) - per_expert
        turn = torch.arange(len(experts)) - first[experts]
        slots = table[experts, (turn + rank) % copies[experts]]
        destinations = slots // per_rank
        send_order = destinations.argsort(stable=True)
        send_counts = torch.bincount(destinations, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        hidden = x.shape[1]
        # Local slot and weight travel together: float64 holds both exactly.
        route = torch.stack(((slots - destinations * per_rank).double(), weights.double()), 1)
        started = time.perf_counter()
        with collective(self.group, "expert dispatch"):
            dist.all_to_all_single(recv_counts, send_counts)
            sends, receives = send_counts.tolist(), recv_counts.tolist()
            received = x.new_empty(sum(receives), hidden)
            dist.all_to_all_single(received, x[rows[send_order]], receives, sends)
            received_route = route.new_empty(sum(receives), 2)
            dist.all_to_all_single(received_route, route[send_order], receives, sends)
        self.computed_tokens += len(received)
        self.exchange_s += time.perf_counter() - started
        computed = local(
            received, received_route[:, 0].long(), received_route[:, 1].to(weights.dtype)
        )
        returned = x.new_empty(len(experts), hidden)
        started = time.perf_counter()
        with collective(self.group, "expert combine"):
            dist.all_to_all_single(returned, computed.contiguous(), sends, receives)
        self.exchange_s += time.perf_counter() - started
        routed = torch.empty_like(returned)
        routed[send_order] = returned
        return routed


@dataclass(frozen=True)
class ExpertSharding:
    """What a model needs to build its MoE layers expert-parallel: the group and the
    placement every layer starts from."""

    group: DistributedGroup
    placement: ExpertPlacement

    def holds(self, expert: int) -> bool:
        return expert in self.placement.rank_experts(self.group.rank)
