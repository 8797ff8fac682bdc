"""Checkpoint loading: GGUF details (rotary permutation, tied embeddings) and safetensors."""

import gguf
import numpy as np
import pytest
import torch

from deepwell.engine.models.gguf_reader import PlainArrayGGUFReader
from deepwell.engine.models.loader import (
    _hf_tensor_name,
    _undo_rotary_permutation,
    embedded_model_path,
    load_checkpoint,
)


@pytest.fixture(scope="module")
def embedded():
    return load_checkpoint(None)


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py `permute` of q/k rows."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_undoing_the_rotary_permutation_restores_hf_rows():
    weight = torch.arange(12 * 5, dtype=torch.float32).view(12, 5)
    for heads in (1, 2, 3):
        assert torch.equal(
            _undo_rotary_permutation(llama_cpp_permute(weight, heads), heads), weight
        )


def test_embedded_gguf_loads_as_a_tied_llama(embedded):
    checkpoint = embedded
    config = checkpoint.hf_config
    assert checkpoint.architecture == "LlamaForCausalLM"
    assert config["tie_word_embeddings"] and "lm_head.weight" not in checkpoint.tensors
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    q = checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.float32 and q.shape == (576, 576)
    assert checkpoint.chat_template and "<|im_start|>" in checkpoint.chat_template


def test_safetensors_directory_loads_with_its_config(tiny_llama):
    checkpoint = load_checkpoint(str(tiny_llama))
    assert checkpoint.architecture == "LlamaForCausalLM"
    assert checkpoint.tokenizer is None
    assert checkpoint.tensors["lm_head.weight"].shape == (320, 64)


def test_a_checkpoint_is_named_after_its_directory_or_file(embedded, tiny_llama, tmp_path):
    versioned = tmp_path / "DeepSeek-V4.1-Flash"
    versioned.symlink_to(tiny_llama, target_is_directory=True)
    assert load_checkpoint(str(versioned)).name == "DeepSeek-V4.1-Flash"
    assert embedded.name == "SmolLM2-135M-Instruct.Q4_1"


def test_embedded_gguf_reads_as_ggufs_own_reader_and_dequantiser(embedded):
    """The plain-array reader's fields and the torch dequantisation of Q4_1 / Q8_0 are gguf's
    own, to the bit: the vocabulary, and a tensor of each kind and permutation (the Q8_0
    embedding, layer 0's Q4_1 projections, permuted q and k among them, and F32 norms)."""
    path = embedded_model_path()
    reference, fast = gguf.GGUFReader(path), PlainArrayGGUFReader(path)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "llama.block_count"):
        assert fast.fields[key].contents() == reference.fields[key].contents()
    config = embedded.hf_config
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    kinds = set()
    for tensor in reference.tensors:
        if not tensor.name.startswith(("blk.0.", "token_embd", "output_norm")):
            continue
        name = _hf_tensor_name(path, tensor.name)
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        expected = torch.from_numpy(np.array(values, dtype=np.float32))
        projection = name.rsplit(".", 2)[-2]
        if projection in heads:
            expected = _undo_rotary_permutation(expected, heads[projection])
        assert torch.equal(embedded.tensors[name], expected), name
        kinds.add(tensor.tensor_type.name)
    assert kinds == {"F32", "Q4_1", "Q8_0"}
