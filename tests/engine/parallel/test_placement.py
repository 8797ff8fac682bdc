"""EPLB's placement: every expert held, replicas of hot experts, ranks balanced, refusals."""

import random

import pytest

from deepwell.engine.parallel.placement import (
    ExpertPlacement,
    balanced_placement,
    check_divisible,
    imbalance,
    worth_moving,
)


def test_uniform_load_places_experts_round_robin():
    placement = balanced_placement([1.0] * 8, 4, 8)
    assert placement.rank_experts(0) == (0, 4)
    assert placement.rank_experts(3) == (3, 7)


def test_skewed_load_gets_replicas_and_a_lower_max_over_mean():
    rng = random.Random(0)
    loads = [rng.paretovariate(1.2) for _ in range(16)]
    before = imbalance(balanced_placement([1.0] * 16, 4, 16).rank_loads(loads))
    placement = balanced_placement(loads, 4, 20)
    after = imbalance(placement.rank_loads(loads))
    assert after < before
    hottest = max(range(16), key=loads.__getitem__)
    assert len(placement.replicas()[hottest]) > 1
    # Each rank the same number of slots, every expert somewhere, replicas on distinct ranks.
    assert sorted(set(placement.slot_experts)) == list(range(16))
    for rank in range(4):
        held = placement.rank_experts(rank)
        assert len(held) == 5 and len(set(held)) == 5


def test_experts_move_only_for_a_gain_of_min_gain_or_more():
    loads = [8.0, 1.0, 8.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    round_robin = balanced_placement([1.0] * 8, 2, 8)  # ranks (0, 2, 4, 6) and (1, 3, 5, 7)
    balanced = balanced_placement(loads, 2, 8)
    gain = imbalance(round_robin.rank_loads(loads)) - imbalance(balanced.rank_loads(loads))
    assert gain > 0.5
    assert worth_moving(loads, round_robin, balanced, 0.05)
    assert not worth_moving(loads, round_robin, balanced, gain + 0.01)
    # Counts that shifted a little: the placement they would give is no real gain.
    nudged = [8.0, 1.0, 8.0, 1.0, 1.0, 1.2, 1.0, 1.0]
    renewed = balanced_placement(nudged, 2, 8)
    assert renewed != balanced
    assert not worth_moving(nudged, balanced, renewed, 0.05)
    assert worth_moving(nudged, balanced, renewed, 0.0) == (
        imbalance(renewed.rank_loads(nudged)) <= imbalance(balanced.rank_loads(nudged))
    )
    assert not worth_moving(loads, balanced, balanced, 0.0)


def test_placement_is_a_function_of_the_loads():
    loads = [5.0, 1.0, 1.0, 9.0, 2.0, 2.0, 0.0, 3.0]
    assert balanced_placement(loads, 2, 10) == balanced_placement(list(loads), 2, 10)


def test_rank_loads_split_a_replicated_expert_evenly():
    placement = ExpertPlacement(2, 2, (0, 1, 0, 1))
    assert placement.rank_loads([4.0, 2.0]) == [3.0, 3.0]


def test_experts_that_do_not_divide_over_the_ranks_are_refused():
    with pytest.raises(ValueError, match="do not divide over 3 expert-parallel ranks"):
        check_divisible(8, 3, 0)
    check_divisible(8, 3, 1)
