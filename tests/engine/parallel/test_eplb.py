"""EPLB's cadence: re-placement every interval of steps from the counts of its last window of
steps (DeepInfer's EXPERT_REARRANGEMENT_STEP_INTERVAL and EXPERT_COUNT_WINDOW_SIZE)."""

import pytest

from deepwell.engine.parallel.eplb import EplbState
from deepwell.settings.parallel import ParallelConfig


def test_counts_restart_a_window_before_each_re_placement():
    state = EplbState(window_steps=3, min_gain=0.0, interval_steps=10)
    assert [s for s in range(31) if state.rebalances_at(s)] == [10, 20, 30]
    assert [s for s in range(31) if state.window_opens_at(s)] == [7, 17, 27]


def test_a_window_as_long_as_the_interval_needs_no_restart():
    state = EplbState(window_steps=5, min_gain=0.0, interval_steps=5)
    assert [s for s in range(16) if state.rebalances_at(s)] == [5, 10, 15]
    assert not any(state.window_opens_at(s) for s in range(16))


def test_the_window_must_fit_the_interval():
    config = ParallelConfig(2, True, enable_eplb=True, eplb_window_steps=8, eplb_step_interval=8)
    assert config.eplb_step_interval == 8
    with pytest.raises(ValueError, match="eplb_window_steps must lie in"):
        ParallelConfig(2, True, enable_eplb=True, eplb_window_steps=9, eplb_step_interval=8)
