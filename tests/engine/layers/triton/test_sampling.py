"""The Triton sampler draws the torch sampler's tokens from the same seeds (interpreter)."""

import pytest
import torch

from deepwell.engine.layers.triton.sampling import TritonSampler
from deepwell.engine.sampling import Sampler

from ...test_sampling import request

FILTERS = [
    {},
    {"top_k": 5},
    {"top_p": 0.8},
    {"min_p": 0.2},
    {"top_k": 40, "top_p": 0.9, "min_p": 0.05, "temperature": 0.7},
    {"top_k": 1},
]


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: "-".join(map(str, f.items())) or "plain")
def test_seeded_draws_are_the_torch_samplers(filters):
    torch.manual_seed(0)
    vocab = 1500  # more than one of the kernel's blocks
    rows = torch.randn(24, vocab) * 3
    rows[:, 7] = rows[:, 9]  # a tie, which stable ranking orders by id
    requests = [request(seed=100 + i, **({"temperature": 1.0} | filters)) for i in range(24)]
    expected, _ = Sampler()(rows.clone(), requests)
    tokens, _ = TritonSampler()(rows.clone(), requests)
    assert tokens == expected
    assert len(set(tokens)) > 1 or filters == {"top_k": 1}


def test_greedy_and_sampled_rows_mix_in_one_batch():
    torch.manual_seed(1)
    rows = torch.randn(4, 300)
    requests = [request(temperature=0), request(seed=3), request(temperature=0), request(seed=4)]
    tokens, _ = TritonSampler()(rows.clone(), requests)
    assert tokens == Sampler()(rows.clone(), requests)[0]
    assert tokens[0] == rows[0].argmax() and tokens[2] == rows[2].argmax()
