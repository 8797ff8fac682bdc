"""The mirror layout: rank r computes chunks r and 2N−1−r, every position exactly once, and
the all-gathered rows come back in sequence order."""

import pytest
import torch

from deepwell.engine.parallel.context_layout import MirrorLayout


@pytest.mark.parametrize(("num_tokens", "size"), [(64, 2), (61, 2), (100, 4), (10, 4), (9, 2)])
def test_every_position_is_on_exactly_one_rank(num_tokens, size):
    layout = MirrorLayout(num_tokens, size)
    positions = torch.cat([layout.positions(rank) for rank in range(size)])
    assert sorted(positions.tolist()) == list(range(num_tokens))
    for rank in range(size):
        assert all(layout.owner(p) == rank for p in layout.positions(rank).tolist())


def test_rank_r_takes_chunk_r_and_its_mirror():
    layout = MirrorLayout(64, 4)  # 8 chunks of 8
    assert layout.spans(0) == (range(0, 8), range(56, 64))
    assert layout.spans(1) == (range(8, 16), range(48, 56))
    assert layout.spans(3) == (range(24, 32), range(32, 40))


def test_causal_work_is_even_across_ranks():
    # Keys a causal query sees, summed over a rank's queries: equal up to one chunk's worth.
    layout = MirrorLayout(4096, 4)
    work = [sum(p + 1 for p in layout.positions(rank).tolist()) for rank in range(4)]
    assert max(work) / min(work) < 1.01
    contiguous = [sum(p + 1 for p in range(r * 1024, (r + 1) * 1024)) for r in range(4)]
    assert max(contiguous) / min(contiguous) > 6  # what a plain split would do


@pytest.mark.parametrize(("num_tokens", "size"), [(61, 2), (100, 4), (10, 4), (7, 4)])
def test_gathered_rows_come_back_in_sequence_order(num_tokens, size):
    layout = MirrorLayout(num_tokens, size)
    # What an all-gather of every rank's padded rows produces, rank by rank.
    gathered = torch.cat(
        [layout.pad(rank, layout.positions(rank).unsqueeze(1) * 10) for rank in range(size)]
    )
    assert gathered[layout.order].squeeze(1).tolist() == [p * 10 for p in range(num_tokens)]


def test_the_last_position_may_live_off_rank_0():
    # 10 tokens over 8 chunks of 2: chunks 5..7 are empty, position 9 is in chunk 4.
    layout = MirrorLayout(10, 4)
    assert layout.spans(0) == (range(0, 2), range(10, 10))
    assert layout.owner(9) == 3
