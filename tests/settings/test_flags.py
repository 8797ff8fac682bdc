"""Engine defaults: one torch-free source that EngineArgs, the command line and serve share."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deepwell.cli import _engine_args, build_parser
from deepwell.engine import EngineArgs
from deepwell.serve.launcher import worker_config
from deepwell.serve.messages import WorkerConfig

ROOT = Path(__file__).resolve().parents[1]

# A fresh interpreter that refuses torch and the engine builds the whole command line,
# parses the torch-free commands and imports what `deepwell serve --mock` runs.
TORCH_FREE = textwrap.dedent(
    """
    import importlib.abc
    import sys

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith(("torch.", "deepwell.engine.")) or (
                name == "deepwell.engine"
            ):
                raise ImportError(f"{name} must not be imported here")
            return None

    sys.meta_path.insert(0, Refuse())
    from deepwell.cli import build_parser
    import deepwell.engine_defaults
    import deepwell.serve.launcher
    import deepwell.serve.messages

    parser = build_parser()
    parser.parse_args(["serve", "--mock"])
    parser.parse_args(["render", "-"])
    print("ok")
    """
)


def test_the_command_line_and_mock_server_import_no_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", TORCH_FREE], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_generate_and_bench_options_default_to_engine_args() -> None:
    parser = build_parser()
    for command in (["bench"], ["generate", "hello"]):
        assert _engine_args(parser.parse_args(command)) == EngineArgs()


def test_bounded_replay_flags_reach_engine_args_and_override_the_environment(
    monkeypatch,
) -> None:
    monkeypatch.setenv("DEEPWELL_YOCO_PREFILL_TRUNCATION_MODE", "mask")
    parser = build_parser()
    assert _engine_args(parser.parse_args(["bench"])).yoco_prefill_truncation_mode == "mask"
    flags = ["--yoco-prefill-truncation-mode", "compact", "--yoco-prefill-keep-tokens", "150"]
    for command in (["bench", *flags], ["generate", "hello", *flags]):
        args = _engine_args(parser.parse_args(command))
        assert (args.yoco_prefill_truncation_mode, args.yoco_prefill_keep_tokens) == (
            "compact",
            150,
        )
    served = parser.parse_args(["serve", *flags])
    assert (served.yoco_prefill_truncation_mode, served.yoco_prefill_keep_tokens) == (
        "compact",
        150,
    )


def test_attention_backend_flag_reaches_engine_args_and_overrides_the_environment(
    monkeypatch,
) -> None:
    parser = build_parser()
    assert _engine_args(parser.parse_args(["bench"])).attention_backend == "auto"
    monkeypatch.setenv("DEEPWELL_ATTENTION_BACKEND", "torch")
    assert _engine_args(parser.parse_args(["bench"])).attention_backend == "torch"
    for command in (["bench"], ["generate", "hello"]):
        args = _engine_args(parser.parse_args([*command, "--attention-backend", "cpp"]))
        assert args.attention_backend == "cpp"
    assert parser.parse_args(["serve", "--attention-backend", "cpp"]).attention_backend == "cpp"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--attention-backend", "triton"])
    monkeypatch.setenv("DEEPWELL_ATTENTION_BACKEND", "triton")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineArgs()


def test_native_decode_flag_reaches_engine_args_and_the_worker_config(monkeypatch) -> None:
    parser = build_parser()
    assert _engine_args(parser.parse_args(["bench"])).native_decode == "auto"
    monkeypatch.setenv("DEEPWELL_NATIVE_DECODE", "off")
    assert _engine_args(parser.parse_args(["bench"])).native_decode == "off"
    for command in (["bench"], ["generate", "hello"]):
        args = _engine_args(parser.parse_args([*command, "--native-decode", "auto"]))
        assert args.native_decode == "auto"
    served = parser.parse_args(["serve", "--native-decode", "off"])
    assert served.native_decode == "off"
    assert worker_config(served, 0, "", "", 0).native_decode == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--native-decode", "on"])


def test_serve_options_and_worker_config_default_to_engine_args() -> None:
    args = build_parser().parse_args(["serve"])
    engine = EngineArgs()
    config = WorkerConfig(
        worker_id=0,
        parent_pid=0,
        model_path=None,
        inbox_address="",
        outbox_address="",
        max_num_seqs=args.max_num_seqs,
        memory_gib=args.memory_gib,
        max_model_len=None,
    )
    served = {
        "max_num_seqs": args.max_num_seqs,
        "memory_gib": args.memory_gib,
        "block_size": args.block_size,
        "num_speculative_tokens": args.num_speculative_tokens,
        "kv_store_capacity_gib": args.kv_store_capacity_gib,
        "kv_store_ttl_chat_s": args.kv_store_ttl_chat,
        "kv_store_ttl_agent_s": args.kv_store_ttl_agent,
    }
    assert served == {name: getattr(engine, name) for name in served}
    shared = {f.name for f in dataclasses.fields(WorkerConfig)} & {
        f.name for f in dataclasses.fields(EngineArgs)
    }
    # None / the environment switches (DEEPWELL_BATCH_INVARIANT, DEEPWELL_YOCO_PREFILL_*,
    # DEEPWELL_ATTENTION_BACKEND, DEEPWELL_NATIVE_DECODE)
    shared -= {
        "max_model_len",
        "batch_invariant",
        "attention_backend",
        "native_decode",
        "yoco_prefill_truncation_mode",
        "yoco_prefill_keep_tokens",
    }
    assert {name: getattr(config, name) for name in shared} == {
        name: getattr(engine, name) for name in shared
    }


def _default_draft_tokens(value: str) -> subprocess.CompletedProcess:
    code = "from deepwell import engine_defaults; print(engine_defaults.NUM_SPECULATIVE_TOKENS)"
    env = {"PATH": "", "DEEPWELL_USE_NEXTN_DECODE": value}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_use_nextn_decode_sets_the_default_draft_length() -> None:
    assert _default_draft_tokens("3").stdout.strip() == "3"
    assert _default_draft_tokens("").stdout.strip() == "5"
    refused = _default_draft_tokens("five")
    assert refused.returncode != 0
    assert "DEEPWELL_USE_NEXTN_DECODE must be an integer" in refused.stderr


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


def test_an_unknown_speculative_method_is_refused() -> None:
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        EngineArgs(speculative_method="medusa")
