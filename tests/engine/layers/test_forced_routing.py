"""The MoE routing overrides of DEEPWELL_FORCE_LOAD_BALANCE / DEEPWELL_FORCE_IMBALANCE_RATIO:
a balanced spread, or the last expert at the set multiple of the mean, each row's experts distinct;
the switches reach EngineArgs and refuse what DeepInfer does not allow."""

import pytest
import torch

from deepwell.engine.build import forced_routing
from deepwell.engine.layers.forced_routing import ForcedRouting
from deepwell.settings.engine import EngineArgs

CPU = torch.device("cpu")


def loads(chosen: torch.Tensor, num_experts: int) -> list[int]:
    return torch.bincount(chosen.flatten(), minlength=num_experts).tolist()


def distinct_within_rows(chosen: torch.Tensor) -> bool:
    return all(len(set(row)) == len(row) for row in chosen.tolist())


@pytest.mark.parametrize("rows", [1, 7, 32, 100])
def test_forced_balance_gives_every_expert_an_equal_share(rows):
    chosen = ForcedRouting().choose(rows, 16, 2, CPU)
    assert chosen.shape == (rows, 2) and distinct_within_rows(chosen)
    share = loads(chosen, 16)
    assert sum(share) == 2 * rows and max(share) - min(share) <= 1


@pytest.mark.parametrize("ratio", [1.0, 2.5, 4.0])
def test_an_imbalance_ratio_makes_the_last_expert_that_many_times_the_mean(ratio):
    rows, experts, top_k = 64, 16, 2
    chosen = ForcedRouting(ratio).choose(rows, experts, top_k, CPU)
    assert distinct_within_rows(chosen)
    share = loads(chosen, experts)
    mean = rows * top_k / experts
    *others, hottest = share
    assert hottest == round(ratio * mean)
    assert sum(share) == rows * top_k
    assert max(others) - min(others) <= 1 and max(others) <= hottest


def test_a_ratio_beyond_one_pair_per_row_gives_the_hot_expert_every_row():
    share = loads(ForcedRouting(100.0).choose(10, 8, 2, CPU), 8)
    assert share[-1] == 10


def test_the_switches_reach_engine_args_and_pick_the_routing(monkeypatch):
    assert forced_routing(EngineArgs("m")) is None
    monkeypatch.setenv("DEEPWELL_FORCE_LOAD_BALANCE", "1")
    assert forced_routing(EngineArgs("m")) == ForcedRouting()
    monkeypatch.setenv("DEEPWELL_FORCE_LOAD_BALANCE", "false")
    monkeypatch.setenv("DEEPWELL_FORCE_IMBALANCE_RATIO", "3")
    assert forced_routing(EngineArgs("m")) == ForcedRouting(3.0)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"DEEPWELL_FORCE_IMBALANCE_RATIO": "0.5"}, "at least 1.0, got 0.5"),
        ({"DEEPWELL_FORCE_IMBALANCE_RATIO": "x"}, "DEEPWELL_FORCE_IMBALANCE_RATIO must be"),
        (
            {"DEEPWELL_FORCE_IMBALANCE_RATIO": "2", "DEEPWELL_FORCE_LOAD_BALANCE": "1"},
            "set one",
        ),
    ],
)
def test_bad_forced_routing_is_refused_naming_the_switch(monkeypatch, environ, message):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        EngineArgs("m")
