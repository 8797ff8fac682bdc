"""The tensor schema equals what nemo's adapters name, shape and store for the same config."""

from __future__ import annotations

import re

import pytest
import torch

from deepwell.engine.models.deepseek_v41.schema import (
    TensorSpec,
    is_deepseek_v41_config,
    tensor_schema,
    vision_schema,
)
from deepwell.engine.models.deepseek_v41.weight_formats import WeightFormat
from deepwell.engine.models.deepseek_v41.writer import (
    SMALL_TEXT_CONFIG,
    TINY_TEXT_CONFIG,
    write_tiny_checkpoint,
)

from .nemo_reference import nemo_draft, nemo_target, nemo_vision_shapes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), text_config=TINY_TEXT_CONFIG)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    # Every width a multiple of 32, as nemo's quantised load targets require (the tiny
    # config's 16-wide Engram table is not).
    return write_tiny_checkpoint(tmp_path_factory.mktemp("small"), text_config=SMALL_TEXT_CONFIG)


def nemo_released(checkpoint_dir, *, quantization: bool) -> dict[str, torch.Tensor]:
    """Every released tensor nemo's two adapters know for this config (placeholders)."""
    options = {"quantization": True, "for_checkpoint_load": True} if quantization else {}
    target, draft = nemo_target(checkpoint_dir), nemo_draft(checkpoint_dir)
    released = target.state_dict_adapter.to_hf(target.state_dict(), **options)
    # The draft adapter also lists the target's embedding and head, which it shares.
    released |= draft.state_dict_adapter.to_hf(draft.state_dict(), **options)
    return released


def test_names_and_logical_shapes_match_nemo_on_the_tiny_config(tiny) -> None:
    schema = tensor_schema(tiny.config["text_config"])
    released = nemo_released(tiny.path, quantization=False)
    assert {name: spec.shape for name, spec in schema.items()} == {
        name: tuple(tensor.shape) for name, tensor in released.items()
    }


def test_stored_names_shapes_and_dtypes_match_nemo_load_targets(small) -> None:
    schema = tensor_schema(small.config["text_config"])
    stored = {}
    for spec in schema.values():
        if spec.format.quantized:
            stored[spec.name] = (spec.format.stored_shape(spec.shape), spec.format.stored_dtype)
            stored[spec.scale_name] = (spec.format.scale_shape(spec.shape), torch.float8_e8m0fnu)
    released = nemo_released(small.path, quantization=True)
    quantized = {
        name: (tuple(tensor.shape), tensor.dtype)
        for name, tensor in released.items()
        if tensor.dtype in (torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu)
    }
    assert stored == quantized


def test_every_layer_kind_of_the_tiny_schedule_gets_its_tensors(tiny) -> None:
    schema = tensor_schema(tiny.config["text_config"])

    def attn(layer: int) -> set[str]:
        prefix = f"layers.{layer}.attn."
        return {
            name.removeprefix(prefix) for name in schema if name.startswith(prefix + "compressor")
        } | {name.removeprefix(prefix) for name in schema if name.startswith(prefix + "indexer")}

    ratio2_source = {
        "compressor.wkv.weight",
        "compressor.wgate.weight",
        "compressor.norm.weight",
        "indexer.wk.weight",
        "indexer.k_norm.weight",
        "indexer.wq_b.weight",
        "indexer.weights_proj.weight",
    }
    assert attn(0) == set()  # window only
    assert attn(1) == ratio2_source  # Full, ratio 2
    assert attn(2) == set()  # Reuse
    assert attn(4) == ratio2_source - {"compressor.wgate.weight"}  # Full, ratio 1
    assert attn(6) == {"indexer.wq_b.weight", "indexer.weights_proj.weight"}  # Reindex
    assert [name for name in schema if name.endswith("engram.embed.weight")] == [
        "layers.0.engram.embed.weight",
        "layers.3.engram.embed.weight",
    ]
    assert "mtp.0.main_proj.weight" in schema and "mtp.1.main_proj.weight" not in schema
    assert "mtp.2.markov_head.head.weight" in schema and "mtp.0.norm.weight" not in schema


def test_formats_follow_the_release_table() -> None:
    schema = tensor_schema(TINY_TEXT_CONFIG)
    formats = {re.sub(r"\d+", "N", name): spec.format for name, spec in schema.items()}
    assert formats["layers.N.attn.wq_b.weight"] is WeightFormat.FP8_BLOCKS
    assert formats["layers.N.attn.indexer.wq_b.weight"] is WeightFormat.FP8_BLOCKS
    assert formats["layers.N.ffn.shared_experts.wN.weight"] is WeightFormat.FP8_BLOCKS
    assert formats["layers.N.engram.wkv.weight"] is WeightFormat.FP8_BLOCKS
    assert formats["mtp.N.main_proj.weight"] is WeightFormat.FP8_BLOCKS
    assert formats["layers.N.ffn.experts.N.wN.weight"] is WeightFormat.MXFP4
    assert formats["mtp.N.ffn.experts.N.wN.weight"] is WeightFormat.MXFP4
    assert formats["layers.N.engram.embed.weight"] is WeightFormat.FP8_ROWS
    for name in ("hc_attn_fn", "attn.attn_sink", "ffn.gate.bias", "ffn.gate.bias_vl"):
        assert formats[f"layers.N.{name}"] is WeightFormat.F32
    assert formats["embed.weight"] is WeightFormat.BF16
    assert TensorSpec("a.weight", (32, 32), WeightFormat.MXFP4).scale_name == "a.scale"


def test_a_config_is_recognised_by_model_type_or_architecture() -> None:
    assert is_deepseek_v41_config({"model_type": "deepseek_v41"})
    assert is_deepseek_v41_config({"architectures": ["DeepseekV41ForCausalLM"]})
    assert not is_deepseek_v41_config({"architectures": ["LlamaForCausalLM"]})


def test_a_missing_config_key_is_named() -> None:
    config = dict(TINY_TEXT_CONFIG)
    del config["o_groups"]
    with pytest.raises(KeyError, match="o_groups"):
        tensor_schema(config)


def test_vision_schema_matches_nemos_vision_tower(tiny) -> None:
    vision = dict(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=96,
        patch_size=4,
        downsample_ratio=2,
    )
    config_json = tiny.config | {"vision_config": {"model_type": "deepseek_v41_vision", **vision}}
    hidden = config_json["text_config"]["hidden_size"]
    schema = vision_schema(config_json["vision_config"], hidden)
    assert {name: spec.shape for name, spec in schema.items()} == nemo_vision_shapes(config_json)
    assert {spec.format for spec in schema.values()} == {WeightFormat.BF16}


def test_a_config_without_vision_layers_has_no_vision_tensors() -> None:
    assert vision_schema({"num_hidden_layers": 0}, 64) == {}


def test_the_head_and_compressor_are_stored_in_bf16_as_released() -> None:
    schema = tensor_schema(TINY_TEXT_CONFIG)
    formats = {re.sub(r"\d+", "N", name): spec.format for name, spec in schema.items()}
    for name in (
        "head.weight",
        "layers.N.attn.compressor.wkv.weight",
        "layers.N.attn.compressor.wgate.weight",
        "mtp.N.confidence_head.proj.weight",
    ):
        assert formats[name] is WeightFormat.BF16, name
