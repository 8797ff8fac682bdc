"""EngineArgs' declarations: each setting declared once, its environment variable read when
EngineArgs is built, its own checks and those across settings."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from deepwell.engine import EngineArgs
from deepwell.serve.messages import WorkerConfig
from deepwell.settings import engine, parallel
from deepwell.settings.declare import declared
from deepwell.settings.parallel import ParallelConfig

SETTINGS = (EngineArgs, ParallelConfig)


def _field_names_in_source(module, class_name: str) -> list[str]:
    """The annotated names of a class body as written, repeats included (a dataclass keeps
    only the last of a name declared twice, silently)."""
    tree = ast.parse(Path(module.__file__).read_text())
    (body,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return [
        node.target.id
        for node in body.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    ]


def test_no_setting_is_declared_twice() -> None:
    names = [
        *_field_names_in_source(engine, "EngineArgs"),
        *_field_names_in_source(parallel, "ParallelConfig"),
    ]
    assert len(names) == len(set(names))
    specs = [spec for cls in SETTINGS for spec in declared(cls).values()]
    flags = [flag for spec in specs for flag in spec.flags]
    assert len(flags) == len(set(flags))
    variables = [spec.env for spec in specs if spec.env]
    assert len(variables) == len(set(variables))
    # Serve's workers carry the settings, not a copy of some of them.
    carried = {f.name for f in dataclasses.fields(WorkerConfig)}
    assert carried.isdisjoint({f.name for cls in SETTINGS for f in dataclasses.fields(cls)})


def test_every_field_is_a_declared_setting_with_help() -> None:
    for cls in SETTINGS:
        names = {f.name for f in dataclasses.fields(cls)} - {"parallel"}
        assert set(declared(cls)) == names
        assert all(spec.help for spec in declared(cls).values())


def test_the_new_settings_change_nothing_by_default(monkeypatch) -> None:
    args = EngineArgs()
    # "auto" is the CPU wherever torch sees no GPU (engine/device.py).
    assert (args.expand_weights, args.device) == (False, "auto")
    monkeypatch.setenv("DEEPWELL_EXPAND_WEIGHTS", "1")
    assert EngineArgs().expand_weights is True
    monkeypatch.setenv("DEEPWELL_DEVICE", "cpu")
    assert EngineArgs().device == "cpu"
    with pytest.raises(ValueError, match="device must be one of"):
        EngineArgs(device="tpu")


def test_use_nextn_decode_sets_the_default_draft_length(monkeypatch) -> None:
    assert EngineArgs().num_speculative_tokens == 5
    monkeypatch.setenv("DEEPWELL_USE_NEXTN_DECODE", "3")
    assert EngineArgs().num_speculative_tokens == 3
    assert EngineArgs(num_speculative_tokens=0).num_speculative_tokens == 0
    monkeypatch.setenv("DEEPWELL_USE_NEXTN_DECODE", "five")
    with pytest.raises(ValueError, match="DEEPWELL_USE_NEXTN_DECODE must be an integer"):
        EngineArgs()


def test_confidence_head_temperature_reads_one_or_per_position_floats(monkeypatch) -> None:
    name = "DEEPWELL_DFLASH_CONFIDENCE_HEAD_TEMPERATURE"
    assert EngineArgs().dspark_confidence_temperature == (1.0,)
    monkeypatch.setenv(name, "0.5,1,2")
    assert EngineArgs().dspark_confidence_temperature == (0.5, 1.0, 2.0)
    monkeypatch.setenv(name, "warm")
    with pytest.raises(ValueError, match=name):
        EngineArgs()
    monkeypatch.setenv(name, "0")
    with pytest.raises(ValueError, match="dspark_confidence_temperature must be positive"):
        EngineArgs()


def test_each_setting_is_checked_by_its_declaration() -> None:
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        EngineArgs(speculative_method="medusa")
    with pytest.raises(ValueError, match="max_num_seqs must be positive, got 0"):
        EngineArgs(max_num_seqs=0)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 0, got -1"):
        EngineArgs(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="kv_store_path needs enable_prefix_caching"):
        EngineArgs(kv_store_path="kv", enable_prefix_caching=False)
