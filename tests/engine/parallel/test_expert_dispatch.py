"""The expert all-to-all's plan: a token travels once to each rank holding some of its
experts, carrying its (slot, weight) pairs; and the collective backend for the tensors' device."""

import torch

from deepwell.engine.parallel.expert import plan_dispatch
from deepwell.engine.parallel.group import backend_for

SLOTS_PER_RANK = 4


def test_a_token_with_two_experts_on_one_rank_is_sent_there_once():
    # Pairs sorted by expert: row 0 → slots 1 and 2 (rank 0) and 5 (rank 1); row 1 → 2 and 6.
    rows = torch.tensor([0, 0, 1, 0, 1])
    slots = torch.tensor([1, 2, 2, 5, 6])
    weights = torch.tensor([0.5, 0.25, 0.75, 0.125, 0.0625])
    destinations = slots // SLOTS_PER_RANK
    plan = plan_dispatch(rows, destinations, slots % SLOTS_PER_RANK, weights, 2, 2, SLOTS_PER_RANK)
    assert plan.token_rows.tolist() == [0, 1, 0, 1]
    assert plan.token_counts.tolist() == [2, 2]
    assert plan.pair_counts.tolist() == [3, 2]
    assert plan.pair_order.tolist() == [0, 1, 2, 3, 4]
    # Each pair finds its token among those sent to its rank, and its slot and weight there.
    index = (plan.routes[:, 0].long() // SLOTS_PER_RANK).tolist()
    assert index == [0, 0, 1, 0, 1]
    assert (plan.routes[:, 0].long() % SLOTS_PER_RANK).tolist() == [1, 2, 2, 1, 2]
    assert plan.routes[:, 1].float().tolist() == weights[plan.pair_order].tolist()


def test_received_tokens_expand_to_every_pairs_own_row():
    generator = torch.Generator().manual_seed(0)
    num_rows, top_k, world = 9, 3, 3
    x = torch.randn(num_rows, 5, generator=generator)
    experts = torch.rand(num_rows, 12, generator=generator).topk(top_k).indices.flatten()
    order = experts.argsort(stable=True)
    rows, slots = order // top_k, experts[order]
    destinations = slots // SLOTS_PER_RANK
    weights = torch.rand(len(rows), generator=generator)
    plan = plan_dispatch(
        rows, destinations, slots % SLOTS_PER_RANK, weights, num_rows, world, SLOTS_PER_RANK
    )
    assert plan.token_counts.sum() < len(rows)
    sent = x[plan.token_rows]
    first = torch.cumsum(plan.token_counts, 0) - plan.token_counts
    pair_destinations = destinations[plan.pair_order]
    index = first[pair_destinations] + plan.routes[:, 0].long() // SLOTS_PER_RANK
    assert torch.equal(sent[index], x[rows[plan.pair_order]])


def test_cuda_tensors_take_nccl_and_host_tensors_gloo():
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(None) == "gloo"
