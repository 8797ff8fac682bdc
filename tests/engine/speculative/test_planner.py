"""The verify-length planner, the step-time curve, the confidence table, n-gram drafts."""

import torch

from deepwell.engine.request import Request
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.speculative import Speculator
from deepwell.engine.speculative.confidence import ConfidenceTable
from deepwell.engine.speculative.ngram import NgramDrafter
from deepwell.engine.speculative.planner import plan_own_verify_length, plan_verify_lengths
from deepwell.engine.speculative.step_time import StepTimeCurve


def _curve(seconds_per_rows) -> StepTimeCurve:
    curve = StepTimeCurve()
    for rows in range(1, 80):
        curve.record(rows, seconds_per_rows(rows))
    return curve


def test_flat_step_time_verifies_every_position_worth_anything():
    lengths = plan_verify_lengths([[0.9, 0.5, 0.2], [0.3]], 2, 2, 100, _curve(lambda r: 1.0))
    assert lengths == [3, 1]


def test_step_time_linear_in_rows_verifies_nothing_with_weak_drafts():
    # Each row costs as much as a whole step's token: a draft position must be a sure thing.
    lengths = plan_verify_lengths([[0.6, 0.3]] * 4, 4, 4, 100, _curve(lambda r: float(r)))
    assert lengths == [0, 0, 0, 0]


def test_extra_rows_go_to_the_top_ranked_positions_so_lengths_differ():
    # A fixed cost plus a per-row cost: only the likeliest positions pay.
    curve = _curve(lambda r: 1.0 + 0.25 * r)
    survival = [[0.95, 0.9, 0.85, 0.8], [0.4, 0.1], [0.9, 0.3]]
    assert plan_verify_lengths(survival, 3, 3, 100, curve) == [4, 0, 1]


def test_the_token_budget_caps_the_extra_rows():
    lengths = plan_verify_lengths([[0.9, 0.9, 0.9]], 1, 1, 2, _curve(lambda r: 1.0))
    assert lengths == [2]


def test_curve_interpolates_and_extends_with_the_measured_slope():
    curve = StepTimeCurve()
    assert curve.estimate(7) == 1.0
    curve.record(2, 0.2)
    curve.record(2, 0.4)
    curve.record(2, 0.3)
    curve.record(6, 0.7)
    assert curve.estimate(2) == 0.3
    assert abs(curve.estimate(4) - 0.5) < 1e-9
    assert abs(curve.estimate(10) - 1.1) < 1e-9


def test_confidence_learns_survival_per_position_and_tracks_its_error():
    table = ConfidenceTable(3)
    assert table.survival(2, 3) == [0.5, 0.5, 0.5]
    for _ in range(50):
        table.observe(2, table.survival(2, 3), 1)
    first, second, third = table.survival(2, 3)
    assert first > 0.9 and second < 0.1 and third <= second
    assert 0 < table.mean_error < 0.5
    # Another match length learns separately.
    assert table.survival(3, 1) == [0.5]


def test_ngram_drafts_the_continuation_of_the_longest_latest_match():
    drafter = NgramDrafter(min_n=2, max_n=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3]
    draft = drafter.lookup("r", tokens, 3)
    assert draft.tokens == [4, 5, 9] and draft.bucket == 3
    tokens += [8]
    assert drafter.lookup("r", tokens, 3) is None
    tokens += [2, 3]
    # The 2-gram [2, 3] last occurred before the 8: its continuation follows.
    assert drafter.lookup("r", tokens, 2).tokens == [8, 2]
    drafter.forget("r")
    assert drafter.lookup("r", [5, 6, 5, 6], 4).tokens == [5, 6]


def test_own_verify_length_weighs_survival_against_a_fixed_row_cost():
    assert plan_own_verify_length([0.9, 0.8, 0.05]) == 2
    assert plan_own_verify_length([0.05, 0.04]) == 0
    assert plan_own_verify_length([0.9, 0.9], row_cost=1.0) == 0


def _request(request_id: str, tokens: list[int]) -> Request:
    """A running request whose tokens are all computed but the last (it decodes next)."""
    params = SamplingParams(max_tokens=64)
    request = Request(request_id, tokens, params, frozenset(), torch.Generator())
    request.num_computed_tokens = len(tokens) - 1
    return request


def test_batch_invariant_verify_length_ignores_the_batch_and_the_step_times():
    """The same request drafts the same verify length alone and beside requests that draft
    with other confidences, whatever the measured step-time curve says; the shared planner
    shortens it there."""
    repeated = [5, 6, 7, 8] * 4

    def lengths(batch_invariant: bool, neighbours: int, seconds_per_row: float) -> int:
        speculator = Speculator(5, NgramDrafter(), batch_invariant=batch_invariant)
        for rows in range(1, 80):
            speculator.record_step(rows, 1.0 + seconds_per_row * rows)
        # Neighbours whose drafts were all rejected before: low confidence, shared table.
        for n in range(neighbours):
            other = _request(f"n{n}", [1, 2, 3, 1, 2, 3, 1, 2])
            for _ in range(4):
                speculator.propose([other], 512)
                speculator.observe(other, len(other.draft_token_ids), 0)
        target = _request("target", repeated)
        batch = [_request(f"m{n}", [9, 10, 11, 9, 10, 11, 9, 10]) for n in range(neighbours)]
        speculator.propose([target, *batch], 512)
        return len(target.draft_token_ids)

    alone = lengths(True, 0, 0.0)
    assert alone > 0
    assert all(lengths(True, n, cost) == alone for n in (1, 7, 40) for cost in (0.0, 0.5))
    assert lengths(False, 40, 0.5) < lengths(False, 0, 0.0)


def test_without_variable_length_verification_the_batch_and_step_times_change_no_length():
    """DeepInfer's ENABLE_MTP_VARLEN off (the default): a request verifies the length its own
    survival gives, beside any neighbours and whatever the step-time curve; on, the shared
    planner shortens it when rows cost much."""
    repeated = [5, 6, 7, 8] * 4

    def length(variable_length: bool, neighbours: int, seconds_per_row: float) -> int:
        speculator = Speculator(5, NgramDrafter(), variable_length=variable_length)
        for rows in range(1, 80):
            speculator.record_step(rows, 1.0 + seconds_per_row * rows)
        target = _request("target", repeated)
        batch = [_request(f"m{n}", [9, 10, 11, 9, 10, 11, 9, 10]) for n in range(neighbours)]
        speculator.propose([target, *batch], 512)
        return len(target.draft_token_ids)

    alone = length(False, 0, 0.0)
    assert alone > 0
    assert all(length(False, n, cost) == alone for n in (1, 7, 40) for cost in (0.0, 2.0))
    assert length(True, 40, 2.0) < alone
