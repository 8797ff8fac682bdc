"""The planner against the released DeepSeek-V4.1-Flash (its config.json, reconstructed from
nemo-automodel 0.7.0's defaults) and against tiny checkpoints' bytes on disk."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from deepwell.engine.errors import MemoryBudgetError, ModelLoadError
from deepwell.engine.models.deepseek_v41.schema import tensor_schema
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint
from deepwell.engine.plan import parse_size, plan_memory, read_footprint, refuse_unfit

from ..models.tiny_qwen import write_tiny_qwen
from ..tiny_llama import write_tiny_llama

FLASH_CONFIG = Path(__file__).parents[1] / "data" / "deepseek_v41_flash_config.json"
GIB = 1 << 30


@pytest.fixture(scope="module")
def tiny_v41(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41")).path


def stored_on_disk(directory: Path) -> tuple[int, int]:
    """(tensors, payload bytes) over every safetensors file of a directory, from the headers."""
    tensors = payload = 0
    for shard in directory.glob("*.safetensors"):
        with shard.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                tensors += 1
                payload += entry["data_offsets"][1] - entry["data_offsets"][0]
    return tensors, payload


def test_the_released_checkpoint_is_counted_exactly() -> None:
    weights = read_footprint(FLASH_CONFIG).weights
    assert weights.params == 763_205_315_794
    assert weights.tensors == 96_085
    assert weights.bytes == 510_286_023_000
    assert f"{weights.bytes / GIB:.2f}" == "475.24"
    kinds = {share.name: share for share in weights.by_kind}
    assert kinds["routed experts"].params == 543_581_798_400
    assert kinds["Engram tables"].params == 196_613_849_600
    assert kinds["DSpark stages"].params == 14_225_362_530
    assert kinds["rest"].params == 8_299_036_784
    assert kinds["vision tower"].params == 485_268_480
    assert kinds["vision tower"].tensors == 266
    # the text model alone, as measured before: 48,230 tensors without their scales
    assert len(tensor_schema(json.loads(FLASH_CONFIG.read_text())["text_config"])) == 48_230
    assert sum(share.bytes for share in weights.by_encoding) == weights.bytes


def test_the_released_caches_take_890_bytes_a_token() -> None:
    kv = read_footprint(FLASH_CONFIG).kv
    assert kv.bytes_per_token == 890
    assert kv.bytes_per_block == 890 * 128
    window, tails, history = (part.bytes for part in kv.state_parts)
    assert window == (40 + 3) * (128 + 6) * 528
    assert tails == 3 * (1 + 6) * 2 * 512 * 4
    assert history == 3 * 8
    assert kv.state_bytes_per_sequence == window + tails + history


def test_the_released_model_fits_1tib_at_128k_context() -> None:
    plan = plan_memory(FLASH_CONFIG, parse_size("1TiB"), max_model_len=131_072)
    assert plan.fits
    assert plan.max_model_len == 131_072
    usable = int((1 << 40) * 0.85) - 510_286_023_000
    assert plan.max_num_seqs == usable // (
        1024 * 890 * 128 + plan.footprint.kv.state_bytes_per_sequence
    )
    assert plan.max_num_seqs > 3000


def test_the_released_model_does_not_fit_256gib_and_says_why() -> None:
    plan = plan_memory(FLASH_CONFIG, parse_size("256GiB"), max_model_len=131_072)
    assert not plan.fits
    assert plan.max_num_seqs == 0
    assert "the weights alone take 475.24 GiB" in plan.reason
    assert "217.60 GiB" in plan.reason  # 256 GiB less the activation reserve
    assert "at least 559.24 GiB" in plan.reason
    assert "--expert-parallel" in plan.reason


def test_a_context_too_long_for_what_the_weights_leave_is_named() -> None:
    # 560 GiB holds the weights (476 GiB usable) but not a 1M-token sequence besides them.
    plan = plan_memory(FLASH_CONFIG, parse_size("560G"), max_num_seqs=1)
    assert not plan.fits
    assert plan.max_model_len == 1_048_576
    assert "1,048,576-token sequence" in plan.reason and "lower --max-model-len" in plan.reason
    assert plan_memory(FLASH_CONFIG, parse_size("560G"), max_model_len=131_072).fits


def test_max_num_seqs_reserves_state_slots_and_caps_the_count() -> None:
    plan = plan_memory(FLASH_CONFIG, parse_size("1TiB"), max_model_len=131_072, max_num_seqs=64)
    assert plan.max_num_seqs == 64
    assert plan.requested_num_seqs == 64


def test_the_tiny_checkpoint_plans_the_bytes_it_stores(tiny_v41: Path) -> None:
    weights = read_footprint(tiny_v41).weights
    assert (weights.tensors, weights.bytes) == stored_on_disk(tiny_v41)


@pytest.mark.parametrize("family", ["llama", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_dense_checkpoints_plan_the_bytes_they_store(family: str, tmp_path: Path) -> None:
    if family == "llama":
        path = write_tiny_llama(tmp_path / family)
    else:
        path = write_tiny_qwen(tmp_path / family, architecture=family)
    footprint = read_footprint(path)
    assert (footprint.weights.tensors, footprint.weights.bytes) == stored_on_disk(path)
    config = json.loads((path / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    # K and V of every layer, float32 (the configs name no dtype)
    assert footprint.kv.bytes_per_token == (
        config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * 4
    )


def test_a_budget_too_small_is_refused_with_the_plan(tiny_v41: Path) -> None:
    with pytest.raises(MemoryBudgetError, match="too small for .*the weights alone take"):
        refuse_unfit(
            str(tiny_v41),
            0.001,
            max_model_len=None,
            max_num_seqs=64,
            block_size=128,
            compute_dtype="float32",
        )
    refuse_unfit(
        str(tiny_v41),
        1.0,
        max_model_len=None,
        max_num_seqs=64,
        block_size=128,
        compute_dtype="float32",
    )


def test_unknown_models_are_left_to_the_loader(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["MambaForCausalLM"]}')
    refuse_unfit(
        str(tmp_path),
        0.001,
        max_model_len=None,
        max_num_seqs=1,
        block_size=128,
        compute_dtype="float32",
    )
    refuse_unfit(
        str(tmp_path / "model.gguf"),
        0.001,
        max_model_len=None,
        max_num_seqs=1,
        block_size=128,
        compute_dtype="float32",
    )
    refuse_unfit(
        None, 0.001, max_model_len=None, max_num_seqs=1, block_size=128, compute_dtype="float32"
    )


def test_bad_configs_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_footprint(tmp_path / "absent")
    with pytest.raises(ModelLoadError, match="config.json' is missing"):
        read_footprint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        read_footprint(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["MambaForCausalLM"]}')
    with pytest.raises(ModelLoadError, match="cannot plan architecture 'MambaForCausalLM'"):
        read_footprint(tmp_path)
    flash = json.loads(FLASH_CONFIG.read_text())
    del flash["text_config"]["o_groups"]
    (tmp_path / "config.json").write_text(json.dumps(flash))
    with pytest.raises(ModelLoadError, match="o_groups"):
        read_footprint(tmp_path)


def test_dense_models_are_planned_in_the_engines_compute_dtype(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "llama")
    stored = read_footprint(path)  # the config names no dtype: float32
    bf16 = read_footprint(path, compute_dtype="bfloat16")
    assert bf16.weights.bytes * 2 == stored.weights.bytes
    assert bf16.kv.bytes_per_token * 2 == stored.kv.bytes_per_token


def test_a_dense_model_is_not_told_to_split_experts(tmp_path: Path) -> None:
    plan = plan_memory(write_tiny_llama(tmp_path / "llama"), 1 << 10)
    assert not plan.fits
    assert "the weights alone take" in plan.reason and "--expert-parallel" not in plan.reason
