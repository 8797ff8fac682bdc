"""The engine flags: generated from the settings' declarations, the same on every command,
free of torch, and reaching EngineArgs and serve's workers."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deepwell.cli import build_parser
from deepwell.engine import EngineArgs
from deepwell.serve.launcher import worker_config
from deepwell.settings.declare import declared
from deepwell.settings.flags import engine_args_from
from deepwell.settings.parallel import ParallelConfig

ROOT = Path(__file__).resolve().parents[2]

# A fresh interpreter that refuses torch builds the whole command line, parses the torch-free
# commands, imports what `deepwell serve --mock` runs and builds the settings a worker is
# sent. The engine's torch-free modules (SamplingParams, RequestOutput and EngineStats travel
# on the wire) may load.
TORCH_FREE = textwrap.dedent(
    """
    import importlib.abc
    import sys

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} must not be imported here")
            return None

    sys.meta_path.insert(0, Refuse())
    from deepwell.cli import build_parser
    import deepwell.serve.launcher
    import deepwell.serve.messages

    parser = build_parser()
    parser.parse_args(["serve", "--mock"])
    parser.parse_args(["render", "-"])
    config = deepwell.serve.launcher.worker_config(parser.parse_args(["serve"]), 0, "", "", 0)
    deepwell.serve.messages.encode_message(config)
    print("ok")
    """
)


def test_the_command_line_and_mock_server_import_no_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", TORCH_FREE], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (subparsers,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def _engine_flags(command: str) -> dict[str, str]:
    """The engine settings' flags `command` takes, with their help."""
    names = {name for name, spec in declared(EngineArgs).items() if spec.flags}
    return {
        flag: action.help
        for action in _subparser(command)._actions
        if action.dest in names
        for flag in action.option_strings
    }


def test_generate_bench_serve_and_worker_take_the_same_engine_flags() -> None:
    expected = {flag for spec in declared(EngineArgs).values() for flag in spec.flags}
    generate = _engine_flags("generate")
    assert set(generate) >= expected
    for command in ("bench", "serve", "worker"):
        assert _engine_flags(command) == generate, command
    for flag in (
        "--model",
        "--dtype",
        "--device",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--kv-store",
        "--kv-store-capacity-gib",
        "--kv-store-ttl-chat",
        "--quantization",
        "--threads",
        "--expand-weights",
    ):
        assert flag in generate, flag


def test_help_names_each_setting_with_its_default_and_variable(capsys) -> None:
    for command in (["bench"], ["generate", "x"], ["serve"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--max-num-seqs MAX_NUM_SEQS requests in one engine step" in text
        assert "(default: DEEPWELL_EXPAND_WEIGHTS or off)" in text
        assert "(default: DEEPWELL_USE_NEXTN_DECODE or 5)" in text
        assert "(default: 7d)" in text


def test_flags_not_given_default_to_engine_args() -> None:
    parser = build_parser()
    for command in (["bench"], ["generate", "hello"], ["serve"], ["worker", "--connect", "x"]):
        assert engine_args_from(parser.parse_args(command)) == EngineArgs()


def test_every_engine_flag_reaches_engine_args_on_every_command() -> None:
    flags = [
        *("--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "3"),
        *("--max-num-batched-tokens", "64", "--threads", "1", "--kv-store", "/tmp/kv"),
        *("--kv-store-capacity-gib", "2", "--kv-store-ttl-chat", "2h", "--expand-weights"),
        *("--no-async-scheduling", "--no-kv-cache-quantization", "--block-size", "16"),
    ]
    expected = {
        "dtype": "float32",
        "max_model_len": 256,
        "max_num_seqs": 3,
        "max_num_batched_tokens": 64,
        "num_threads": 1,
        "kv_store_path": "/tmp/kv",
        "kv_store_capacity_gib": 2.0,
        "kv_store_ttl_chat_s": 7200.0,
        "expand_weights": True,
        "async_scheduling": False,
        "quantize_kv_cache": False,
        "block_size": 16,
    }
    parser = build_parser()
    for command in (["bench"], ["generate", "hello"], ["serve"]):
        args = engine_args_from(parser.parse_args([*command, *flags]))
        assert {name: getattr(args, name) for name in expected} == expected, command


def test_bounded_replay_flags_override_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("DEEPWELL_YOCO_PREFILL_TRUNCATION_MODE", "mask")
    parser = build_parser()
    assert engine_args_from(parser.parse_args(["bench"])).yoco_prefill_truncation_mode == "mask"
    flags = ["--yoco-prefill-truncation-mode", "compact", "--yoco-prefill-keep-tokens", "150"]
    for command in (["bench"], ["generate", "hello"], ["serve"]):
        args = engine_args_from(parser.parse_args([*command, *flags]))
        assert (args.yoco_prefill_truncation_mode, args.yoco_prefill_keep_tokens) == (
            "compact",
            150,
        )


def test_attention_backend_flag_overrides_the_environment(monkeypatch) -> None:
    parser = build_parser()
    assert engine_args_from(parser.parse_args(["bench"])).attention_backend == "auto"
    monkeypatch.setenv("DEEPWELL_ATTENTION_BACKEND", "torch")
    assert engine_args_from(parser.parse_args(["bench"])).attention_backend == "torch"
    for command in (["bench"], ["generate", "hello"], ["serve"]):
        args = engine_args_from(parser.parse_args([*command, "--attention-backend", "cpp"]))
        assert args.attention_backend == "cpp"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--attention-backend", "triton"])
    monkeypatch.setenv("DEEPWELL_ATTENTION_BACKEND", "triton")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineArgs()


def test_batch_invariance_comes_from_the_flag_or_the_environment(monkeypatch) -> None:
    parser = build_parser()
    assert not engine_args_from(parser.parse_args(["bench"])).batch_invariant
    assert engine_args_from(parser.parse_args(["bench", "--batch-invariant"])).batch_invariant
    monkeypatch.setenv("DEEPWELL_BATCH_INVARIANT", "1")
    assert engine_args_from(parser.parse_args(["bench"])).batch_invariant
    monkeypatch.setenv("DEEPWELL_BATCH_INVARIANT", "0")
    assert not engine_args_from(parser.parse_args(["bench"])).batch_invariant


def test_the_worker_config_carries_the_settings_the_flags_and_environment_give(
    monkeypatch,
) -> None:
    monkeypatch.setenv("DEEPWELL_NATIVE_DECODE", "off")
    parser = build_parser()
    served = parser.parse_args(["serve", "m.gguf", "--max-num-seqs", "5", "--kv-store", "kv"])
    engine = worker_config(served, 0, "", "", 0).engine
    assert (engine.model, engine.max_num_seqs, engine.kv_store_path) == ("m.gguf", 5, "kv")
    assert engine.native_decode == "off"
    assert engine == EngineArgs(model="m.gguf", max_num_seqs=5, kv_store_path="kv")


def test_worker_configs_of_a_data_parallel_serve_are_its_ranks() -> None:
    served = build_parser().parse_args(
        ["serve", "--data-parallel-size", "4", "--nnodes", "2", "--node-rank", "1"]
    )
    ranks = [worker_config(served, i, "", "", 0).engine.parallel.rank for i in range(2)]
    assert ranks == [2, 3]
    assert worker_config(served, 0, "", "", 0).engine.parallel == ParallelConfig(
        data_parallel_size=4, nnodes=2, node_rank=1, rank=2
    )


def test_settings_that_do_not_combine_are_refused_before_a_worker_starts() -> None:
    served = build_parser().parse_args(["serve", "--quantization", "int4", "--batch-invariant"])
    with pytest.raises(ValueError, match="int4 quantization cannot run batch-invariant"):
        worker_config(served, 0, "", "", 0)
