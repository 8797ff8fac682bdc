"""DeepInfer's switches: each mirrored under its own suffix with DeepInfer's type, default and
reading, or listed with the reason it is not; the generated table in the docs is current."""

from __future__ import annotations

from pathlib import Path

import deepwell.serve.settings  # noqa: F401 - registers DEEPWELL_API_KEY
from deepwell.settings import environment
from deepwell.settings.engine import EngineArgs
from deepwell.settings.parallel import ParallelConfig
from deepwell.settings.switches import DEEPINFER_SWITCHES, render, twin

DOCS = Path(__file__).resolve().parents[2] / "docs" / "switches.md"
# spec/deepinfer.md §1.4: type and default of each switch deepwell mirrors.
DEEPINFER_TYPES = {
    "DEEPINFER_GLOO_TIMEOUT": ("float", 14400.0),
    "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS": ("int", 0),
    "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": ("int", 100),
    "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": ("int", 0),
    "DEEPINFER_PREFILL_MAX_SUM_SEQLEN_K": ("int", None),
    "DEEPINFER_USE_NEXTN_DECODE": ("int", 5),
    "DEEPINFER_ENABLE_MTP_VARLEN": ("bool", False),
    "DEEPINFER_MAX_BACKTRACKING_TOKENS": ("int", 0),
    "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE": ("floats", (1.0,)),
    "DEEPINFER_SAMPLER_FORCE_TOPK": ("int", 0),
    "DEEPINFER_DECODE_TOKEN_BLACKLIST": ("ids", ()),
    "DEEPINFER_NUM_STATE_SLOTS_RATIO": ("float", 1.2),
    # DeepInfer's 1; here auto, as measured (docs/benchmarks.md, "asynchronous scheduling with DSpark").
    "DEEPINFER_ZERO_OVERHEAD_SCHEDULING": ("bool", None),
    "DEEPINFER_LOGGING_INTERVAL_STEP": ("int", 100),
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": ("str", "off"),
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": ("int", 140),
    "DEEPINFER_BATCH_INVARIANT": ("bool", False),
    "DEEPINFER_ENFORCE_EAGER": ("bool", False),
    "DEEPINFER_USE_MULTIMODAL_POOL": ("bool", True),
    "DEEPINFER_COMPUTE_SUM_SMALLER_PROBS": ("bool", False),
    "DEEPINFER_FORCE_IMBALANCE_RATIO": ("float", 0.0),
    "DEEPINFER_FORCE_LOAD_BALANCE": ("bool", False),
}
PARSERS = {
    "bool": environment.parse_flag,
    "int": environment.parse_int,
    "float": environment.parse_float,
    "floats": environment.parse_floats,
    "ids": environment.parse_token_ids,
    "str": environment.parse_text,
}


def test_the_checked_in_table_is_current() -> None:
    assert DOCS.read_text() == render(), "run `deepwell switches > docs/switches.md`"


def test_each_mirrored_switch_has_deepinfers_type_and_default() -> None:
    registry = environment.registered()
    mirrored = {name for name, reason in DEEPINFER_SWITCHES.items() if reason is None}
    assert mirrored == set(DEEPINFER_TYPES)
    for name, (kind, default) in DEEPINFER_TYPES.items():
        variable = registry[twin(name)]
        assert variable.parse is PARSERS[kind], name
        assert variable.default == default, name


def test_every_switch_that_is_not_mirrored_says_why() -> None:
    registry = environment.registered()
    for name, reason in DEEPINFER_SWITCHES.items():
        assert name.startswith("DEEPINFER_")
        if reason is not None:
            assert len(reason) > 10 and twin(name) not in registry, name
            assert "not yet" not in reason, name
    # spec/deepinfer.md §1.4 names 63 (its C++ log level and test-only switches included).
    assert len(DEEPINFER_SWITCHES) == 63


def test_mirrored_switches_set_the_engine_and_parallel_settings(monkeypatch) -> None:
    for name, value in {
        "DEEPWELL_ENABLE_MTP_VARLEN": "1",
        "DEEPWELL_MAX_BACKTRACKING_TOKENS": "9",
        "DEEPWELL_NUM_STATE_SLOTS_RATIO": "2.5",
        "DEEPWELL_SAMPLER_FORCE_TOPK": "40",
        "DEEPWELL_DECODE_TOKEN_BLACKLIST": "7, 11,13",
        "DEEPWELL_PREFILL_MAX_SUM_SEQLEN_K": "4096",
        "DEEPWELL_LOGGING_INTERVAL_STEP": "0",
        "DEEPWELL_ZERO_OVERHEAD_SCHEDULING": "",
        "DEEPWELL_GLOO_TIMEOUT": "30",
        "DEEPWELL_EXPERT_COUNT_WINDOW_SIZE": "8",
        "DEEPWELL_EXPERT_REARRANGEMENT_STEP_INTERVAL": "24",
        "DEEPWELL_COMPUTE_SUM_SMALLER_PROBS": "true",
        "DEEPWELL_FORCE_IMBALANCE_RATIO": "2.5",
    }.items():
        monkeypatch.setenv(name, value)
    args = EngineArgs()
    assert args.enable_mtp_varlen is True
    assert args.max_backtracking_tokens == 9
    assert args.num_state_slots_ratio == 2.5
    assert args.sampler_force_topk == 40
    assert args.decode_token_blacklist == (7, 11, 13)
    assert args.prefill_max_sum_seqlen_k == 4096
    assert args.logging_interval_step == 0
    assert args.compute_sum_smaller_probs is True
    assert (args.force_imbalance_ratio, args.force_load_balance) == (2.5, False)
    # An empty switch is off, as DeepInfer reads it.
    assert args.async_scheduling is False
    parallel = ParallelConfig()
    assert (parallel.timeout_s, parallel.eplb_window_steps) == (30.0, 8)
    assert parallel.eplb_step_interval == 24
