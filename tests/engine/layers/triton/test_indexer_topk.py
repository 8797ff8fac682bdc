"""The Triton top-k against the indexer's torch selection, through Triton's interpreter."""

import pytest
import torch

from deepwell.engine.layers.batch_invariant import top_indices
from deepwell.engine.layers.triton.indexer_topk import top_k_ids


def torch_selection(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indexer.select's rule with ties to the lower id (the batch-invariant path's)."""
    _, ids = top_indices(scores, k)
    ids = ids.sort(dim=-1).values
    return torch.where(scores.gather(-1, ids) > float("-inf"), ids, -1)


@pytest.mark.parametrize("rows, width, k", [(4, 10, 4), (3, 300, 17), (2, 5, 5), (1, 129, 128)])
def test_matches_the_torch_selection(rows, width, k) -> None:
    generator = torch.Generator().manual_seed(width)
    scores = torch.randn(rows, width, generator=generator) * 100
    assert torch.equal(top_k_ids(scores, k), torch_selection(scores, k))


def test_ties_go_to_the_lower_id_and_signed_zeros_tie() -> None:
    scores = torch.tensor(
        [
            [1.0, 3.0, 3.0, 3.0, 2.0, 3.0],
            [0.0, -0.0, 0.0, -1.0, -0.0, 5.0],
            [-2.0, -2.0, -2.0, -2.0, -2.0, -2.0],
        ]
    )
    assert top_k_ids(scores, 3).tolist() == [[1, 2, 3], [0, 1, 5], [0, 1, 2]]
    assert torch.equal(top_k_ids(scores, 3), torch_selection(scores, 3))


def test_hidden_entries_are_minus_one_in_place() -> None:
    inf = float("inf")
    scores = torch.tensor([[0.5, -inf, -inf, 0.25, -inf], [inf, -inf, -inf, -inf, -inf]])
    assert top_k_ids(scores, 3).tolist() == [[0, -1, 3], [0, -1, -1]]


def test_k_past_the_row_width_is_refused() -> None:
    with pytest.raises(ValueError, match="k must be in 1..5"):
        top_k_ids(torch.zeros(2, 5), 6)
