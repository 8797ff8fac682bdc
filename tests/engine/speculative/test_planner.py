"""The verify-length planner, the step-time curve, the confidence table, n-gram drafts."""

from deepwell.engine.speculative.confidence import ConfidenceTable
from deepwell.engine.speculative.ngram import NgramDrafter
from deepwell.engine.speculative.planner import plan_verify_lengths
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
