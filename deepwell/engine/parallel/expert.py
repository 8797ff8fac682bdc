"""One MoE layer's token exchange across expert-parallel ranks: each token goes once to every
rank holding a replica of one of its experts, with its (expert slot, weight) pairs there; each
pair is computed there and its weighted output comes back (all-to-all)."""

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


@dataclass(frozen=True)
class Dispatch:
    """One rank's side of a dispatch: which of its tokens go where, and the pairs they carry.

    Tokens are (row, destination) pairs without repeats, sorted by destination then row; pairs
    are sorted by destination, in the layer's pair order within one (`pair_order`)."""

    token_rows: torch.Tensor
    token_counts: torch.Tensor
    pair_order: torch.Tensor
    pair_counts: torch.Tensor
    # Per pair, in `pair_order`: its token's index among those sent to its destination and
    # its local slot there, packed as index * slots_per_rank + slot; then its weight.
    # float64 holds both exactly (indices far below 2**53, weights float32).
    routes: torch.Tensor


def plan_dispatch(
    rows: torch.Tensor,
    destinations: torch.Tensor,
    local_slots: torch.Tensor,
    weights: torch.Tensor,
    num_rows: int,
    world_size: int,
    slots_per_rank: int,
) -> Dispatch:
    """What to send for pairs (`rows`, `destinations`, `local_slots`, `weights`) of a layer
    over `num_rows` input rows: a row routed to k experts on one rank travels there once."""
    keys = destinations * num_rows + rows
    unique_keys, pair_token = torch.unique(keys, sorted=True, return_inverse=True)
    token_destinations = unique_keys // num_rows
    token_counts = torch.bincount(token_destinations, minlength=world_size)
    first_token = torch.cumsum(token_counts, 0) - token_counts
    index = pair_token - first_token[destinations]
    pair_order = destinations.argsort(stable=True)
    packed = (index * slots_per_rank + local_slots).double()
    routes = torch.stack((packed, weights.double()), 1)[pair_order]
    return Dispatch(
        token_rows=unique_keys % num_rows,
        token_counts=token_counts,
        pair_order=pair_order,
        pair_counts=torch.bincount(destinations, minlength=world_size),
        routes=routes,
    )


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
        # Bytes this rank sent to other ranks: tokens and their routes out, outputs back.
        self.dispatch_bytes = 0
        self.combine_bytes = 0

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
        if table.device != x.device:
            # Once per placement on an accelerator: the tables live beside the tokens.
            table, copies = table.to(x.device), copies.to(x.device)
            self._tables = (placement, table, copies)
            self.expert_tokens = self.expert_tokens.to(x.device)
        rank, world = self.group.rank, self.group.world_size
        per_rank = placement.slots_per_rank
        per_expert = torch.bincount(experts, minlength=placement.num_experts)
        self.expert_tokens += per_expert
        first = torch.cumsum(per_expert, 0) - per_expert
        turn = torch.arange(len(experts), device=x.device) - first[experts]
        slots = table[experts, (turn + rank) % copies[experts]]
        destinations = slots // per_rank
        plan = plan_dispatch(
            rows, destinations, slots - destinations * per_rank, weights, len(x), world, per_rank
        )
        hidden = x.shape[1]
        started = time.perf_counter()
        with collective(self.group, "expert dispatch"):
            # Counts first (tokens and pairs per rank): the one host sync of the layer, as
            # the all-to-alls below take their split sizes on the host.
            send_counts = torch.stack((plan.token_counts, plan.pair_counts), 1)
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts)
            send_tokens, send_pairs = send_counts.t().tolist()
            recv_tokens, recv_pairs = recv_counts.t().tolist()
            tokens = x.new_empty(sum(recv_tokens), hidden)
            dist.all_to_all_single(tokens, x[plan.token_rows], recv_tokens, send_tokens)
            routes = plan.routes.new_empty(sum(recv_pairs), 2)
            dist.all_to_all_single(routes, plan.routes, recv_pairs, send_pairs)
        self.exchange_s += time.perf_counter() - started
        self.computed_tokens += len(routes)
        self.dispatch_bytes += (sum(send_tokens) - send_tokens[rank]) * hidden * x.element_size()
        self.dispatch_bytes += (sum(send_pairs) - send_pairs[rank]) * 2 * routes.element_size()
        # A source's token indices count from its first token here.
        token_base = torch.cumsum(recv_counts[:, 0], 0) - recv_counts[:, 0]
        source = torch.repeat_interleave(token_base, recv_counts[:, 1], output_size=sum(recv_pairs))
        packed = routes[:, 0].long()
        computed = local(
            tokens[source + packed // per_rank], packed % per_rank, routes[:, 1].to(weights.dtype)
        )
        returned = x.new_empty(len(experts), hidden)
        started = time.perf_counter()
        with collective(self.group, "expert combine"):
            dist.all_to_all_single(returned, computed.contiguous(), send_pairs, recv_pairs)
        self.exchange_s += time.perf_counter() - started
        self.combine_bytes += (sum(recv_pairs) - recv_pairs[rank]) * hidden * x.element_size()
        routed = torch.empty_like(returned)
        routed[plan.pair_order] = returned
        return routed


@dataclass(frozen=True)
class ExpertSharding:
    """What a model needs to build its MoE layers expert-parallel: the group and the
    placement every layer starts from."""

    group: DistributedGroup
    placement: ExpertPlacement

    def holds(self, expert: int) -> bool:
        return expert in self.placement.rank_experts(self.group.rank)
