"""Mapping a V4.1 directory: every tensor comes back in its stored encoding as a view of the
shard file, dequantises to the writer's weights, nemo reads the same; bad input is a
ModelLoadError naming the tensor and the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.models.deepseek_v41.checkpoint import (
    INDEX_FILE,
    dequantized,
    load_v41_checkpoint,
)
from deepwell.engine.models.deepseek_v41.safetensors_map import MappedShard
from deepwell.engine.models.deepseek_v41.schema import tensor_schema
from deepwell.engine.models.deepseek_v41.weight_formats import WeightFormat, dequantize, quantize
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint
from deepwell.engine.models.loader import load_checkpoint

from .nemo_reference import nemo_draft, nemo_target

# Largest error relative to a tensor's largest magnitude: half a step at the top binade.
RELATIVE_ERROR = {
    WeightFormat.BF16: 2**-8,
    WeightFormat.F32: 0.0,
    WeightFormat.FP8_BLOCKS: 2**-4,
    WeightFormat.FP8_ROWS: 2**-4,
    WeightFormat.MXFP4: 2**-2,
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=0)


@pytest.fixture(scope="module")
def loaded(written):
    return load_checkpoint(str(written.path))


@pytest.fixture
def copy(written, tmp_path) -> Path:
    """A private copy of the tiny checkpoint to damage."""
    return Path(shutil.copytree(written.path, tmp_path / "copy"))


def index(path: Path) -> dict[str, str]:
    return json.loads((path / INDEX_FILE).read_text())["weight_map"]


def write_index(path: Path, weight_map: dict[str, str]) -> None:
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def rewrite_shard(path: Path, file: str, change) -> None:
    """Load one shard, let `change` edit its tensors in place, write it back."""
    tensors = load_file(path / file)
    change(tensors)
    save_file(tensors, str(path / file))


def stored_names(schema) -> list[str]:
    return [name for spec in schema.values() for name in (spec.name, spec.scale_name) if name]


def test_the_loader_returns_every_released_tensor_as_stored(written, loaded) -> None:
    schema = tensor_schema(written.config["text_config"])
    assert loaded.architecture == "DeepseekV41ForCausalLM"
    assert loaded.hf_config == written.config
    assert list(loaded.tensors) == stored_names(schema)
    stored = {}
    for file in written.shards:
        stored |= load_file(written.path / file)
    for name, tensor in loaded.tensors.items():
        assert tensor.dtype == stored[name].dtype, name
        assert torch.equal(tensor.view(torch.uint8), stored[name].view(torch.uint8)), name
    assert {name.split(".")[0] for name in loaded.tensors} == {
        "embed",
        "norm",
        "head",
        "layers",
        "mtp",
    }


def test_tensors_are_views_of_the_mapped_shards_not_copies(written, loaded) -> None:
    name = "layers.3.ffn.experts.1.w2.weight"
    shard = MappedShard(written.path / index(written.path)[name])
    tensor = loaded.tensors[name]
    # Its storage is the whole file's mapping, and it starts where the header says.
    assert tensor.untyped_storage().nbytes() == (written.path / shard.path.name).stat().st_size
    entry = shard.entries[name]
    assert tensor.storage_offset() * tensor.element_size() == shard.data_start + entry.begin


def test_each_tensor_is_what_was_written_up_to_its_storage_rounding(written, loaded) -> None:
    schema = tensor_schema(written.config["text_config"])
    for name, spec in schema.items():
        original, restored = written.weights[name], dequantized(loaded.tensors, spec)
        # Exactly the format's own rounding (whose bounds test_weight_formats checks) ...
        assert torch.equal(restored, dequantize(spec.format, *quantize(spec.format, original)))
        # ... which stays within half a step of the largest value.
        error = (restored - original).abs().max()
        assert error <= RELATIVE_ERROR[spec.format] * original.abs().max(), name


def test_a_weight_and_its_scale_in_different_shards_load_together(written, loaded) -> None:
    weight_map = index(written.path)
    split = [
        name
        for name, spec in tensor_schema(written.config["text_config"]).items()
        if spec.scale_name and weight_map[name] != weight_map[spec.scale_name]
    ]
    assert split, "the tiny checkpoint should split at least one pair across shards"
    assert len(written.shards) > 1
    schema = tensor_schema(written.config["text_config"])
    for name in split:
        assert torch.isfinite(dequantized(loaded.tensors, schema[name])).all()


def test_the_tokenizer_and_its_config_are_loaded_beside_the_weights(written, loaded) -> None:
    assert loaded.tokenizer is not None
    assert loaded.tokenizer.get_vocab_size() == written.config["text_config"]["vocab_size"]
    assert loaded.chat_template is None  # V4.1 prompts come from deepwell.recipe's encoder


def test_nemo_dequantises_our_shards_to_the_same_tensors(written, loaded) -> None:
    stored = {}
    for file in written.shards:
        stored |= load_file(written.path / file)
    target, draft = nemo_target(written.path), nemo_draft(written.path)
    backbone = {name: t for name, t in stored.items() if not name.startswith("mtp.")}
    target.load_state_dict(target.state_dict_adapter.from_hf(backbone), strict=True)
    drafted = {
        name: t for name, t in stored.items() if name.startswith(("mtp.", "embed.", "head."))
    }
    draft.load_state_dict(draft.state_dict_adapter.from_hf(drafted), strict=True)
    released = target.state_dict_adapter.to_hf(target.state_dict())
    released |= draft.state_dict_adapter.to_hf(draft.state_dict())
    schema = tensor_schema(written.config["text_config"])
    assert released.keys() == schema.keys()
    for name, tensor in released.items():
        assert torch.equal(tensor.float(), dequantized(loaded.tensors, schema[name])), name


def test_load_checkpoint_routes_by_model_type_alone(copy) -> None:
    config = json.loads((copy / "config.json").read_text())
    del config["architectures"]
    (copy / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(str(copy)).architecture == "DeepseekV41ForCausalLM"


# --- bad input ---


def test_a_missing_shard_names_the_file_and_a_tensor(copy) -> None:
    victim = sorted(set(index(copy).values()))[1]
    (copy / victim).unlink()
    with pytest.raises(ModelLoadError, match=rf"shard .*{victim}.* is missing .*'layers\."):
        load_v41_checkpoint(copy)


def test_a_truncated_shard_names_the_file(copy) -> None:
    victim = sorted(set(index(copy).values()))[2]
    data = (copy / victim).read_bytes()
    (copy / victim).write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=rf"cannot read shard .*{victim}.*truncated"):
        load_v41_checkpoint(copy)


def test_a_shard_of_garbage_names_the_file(copy) -> None:
    victim = sorted(set(index(copy).values()))[0]
    (copy / victim).write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match=rf"cannot read shard .*{victim}"):
        load_v41_checkpoint(copy)


def test_an_unknown_tensor_is_named_with_its_file(copy) -> None:
    save_file({"layers.0.attn.wq_c.weight": torch.zeros(2, 2)}, str(copy / "extra.safetensors"))
    write_index(copy, index(copy) | {"layers.0.attn.wq_c.weight": "extra.safetensors"})
    with pytest.raises(
        ModelLoadError, match=r"unknown tensor 'layers.0.attn.wq_c.weight' in 'extra"
    ):
        load_v41_checkpoint(copy)


def test_vision_tower_tensors_are_left_unread(copy) -> None:
    save_file({"vision.patch_embed.weight": torch.zeros(2, 2)}, str(copy / "vision.safetensors"))
    write_index(copy, index(copy) | {"vision.patch_embed.weight": "vision.safetensors"})
    assert "vision.patch_embed.weight" not in load_v41_checkpoint(copy).tensors


def test_a_tensor_missing_from_the_index_is_named(copy) -> None:
    weight_map = index(copy)
    del weight_map["layers.5.attn.wo_b.scale"]
    write_index(copy, weight_map)
    with pytest.raises(
        ModelLoadError, match=rf"'layers.5.attn.wo_b.scale' is missing from .*{INDEX_FILE}"
    ):
        load_v41_checkpoint(copy)


def test_a_tensor_missing_from_its_shard_is_named_with_the_shard(copy) -> None:
    file = index(copy)["layers.2.ffn.gate.bias"]
    rewrite_shard(copy, file, lambda tensors: tensors.pop("layers.2.ffn.gate.bias"))
    with pytest.raises(ModelLoadError, match=rf"'layers.2.ffn.gate.bias' is not in .*{file}"):
        load_v41_checkpoint(copy)


def test_a_wrong_shape_names_the_tensor_file_and_shapes(copy) -> None:
    name = "layers.1.attn.indexer.wk.weight"
    file = index(copy)[name]

    def transpose(tensors):
        tensors[name] = torch.zeros(32, 16, dtype=tensors[name].dtype)

    rewrite_shard(copy, file, transpose)
    with pytest.raises(
        ModelLoadError, match=rf"'{name}' in .*{file}.* shape \[32, 16\], expected \[32, 32\]"
    ):
        load_v41_checkpoint(copy)


def test_a_wrong_dtype_names_the_tensor_and_the_stored_form(copy) -> None:
    name = "layers.3.ffn.experts.1.w2.weight"  # MXFP4: must be I8
    file = index(copy)[name]

    def widen(tensors):
        tensors[name] = tensors[name].to(torch.bfloat16)

    rewrite_shard(copy, file, widen)
    with pytest.raises(
        ModelLoadError, match=rf"'{name}' in .*{file}.* is BF16; a mxfp4 weight is stored as I8"
    ):
        load_v41_checkpoint(copy)


def test_a_scale_must_be_e8m0(copy) -> None:
    name = "mtp.0.main_proj.scale"
    file = index(copy)[name]
    rewrite_shard(copy, file, lambda t: t.__setitem__(name, t[name].to(torch.float32)))
    with pytest.raises(ModelLoadError, match=rf"'{name}' .* is F32; .* stored as F8_E8M0"):
        load_v41_checkpoint(copy)


def test_unquantised_tensors_may_be_stored_in_either_full_precision(copy) -> None:
    name = "head.weight"  # F32 in nemo, BF16 in the spec's table
    file = index(copy)[name]
    rewrite_shard(copy, file, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    with safe_open(str(copy / file), "pt") as shard:
        assert shard.get_slice(name).get_dtype() == "BF16"
    assert load_v41_checkpoint(copy).tensors[name].dtype == torch.bfloat16


def test_a_config_without_a_needed_key_is_named(copy) -> None:
    config = json.loads((copy / "config.json").read_text())
    del config["text_config"]["index_head_dim"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config.json'?: text_config lacks 'index_head_dim'"):
        load_v41_checkpoint(copy)


def test_a_missing_index_or_tokenizer_is_named(copy) -> None:
    (copy / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer.json' is missing; .*Engram"):
        load_v41_checkpoint(copy)
    (copy / INDEX_FILE).unlink()
    with pytest.raises(ModelLoadError, match=rf"{INDEX_FILE}' is missing"):
        load_v41_checkpoint(copy)
