"""A model built from a checkpoint skips its random initial weights: after load_weights it
holds the checkpoint's values exactly as a randomly initialised one did, and a checkpoint
that leaves a parameter unset is still refused."""

import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.layers.torch_paged import TorchPagedAttention
from deepwell.engine.models.loader import load_checkpoint
from deepwell.engine.models.registry import ModelOptions, build_model, model_entry
from deepwell.engine.models.skip_init import skip_random_init

from .tiny_qwen import write_tiny_qwen


def loaded_both_ways(checkpoint, dtype):
    """The model built from the checkpoint (random init skipped) and one constructed directly
    (random init drawn), each with the checkpoint's weights loaded."""
    options = ModelOptions(dtype=dtype, backend_class=TorchPagedAttention)
    generator = torch.get_rng_state()
    built = build_model(checkpoint, options)
    assert torch.equal(torch.get_rng_state(), generator), "build_model drew random weights"
    model_class = model_entry(checkpoint.architecture).model_class
    config = model_class.read_config(checkpoint.hf_config)
    drawn = model_class(config, TorchPagedAttention, dtype)
    for model in (built, drawn):
        model.load_weights(checkpoint.tensors)
    return built, drawn


def assert_same_state(built: nn.Module, drawn: nn.Module) -> None:
    expected = drawn.state_dict()
    state = built.state_dict()
    assert list(state) == list(expected)
    for name, value in state.items():
        assert value.dtype == expected[name].dtype, name
        assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_llama_loads_the_same_bits_without_random_init(tiny_llama, dtype):
    assert_same_state(*loaded_both_ways(load_checkpoint(str(tiny_llama)), dtype))


def test_qwen2_with_qkv_biases_loads_the_same_bits_without_random_init(tmp_path):
    checkpoint = load_checkpoint(str(write_tiny_qwen(tmp_path / "qwen2")))
    assert_same_state(*loaded_both_ways(checkpoint, torch.float32))


def test_embedded_model_loads_the_same_bits_without_random_init():
    assert_same_state(*loaded_both_ways(load_checkpoint(None), torch.bfloat16))


def test_a_checkpoint_missing_a_parameter_is_still_refused(tiny_llama):
    checkpoint = load_checkpoint(str(tiny_llama))
    del checkpoint.tensors["model.layers.1.post_attention_layernorm.weight"]
    model = build_model(checkpoint, ModelOptions(torch.float32, TorchPagedAttention))
    with pytest.raises(ModelLoadError, match="post_attention_layernorm"):
        model.load_weights(checkpoint.tensors)


def test_skipping_leaves_the_random_generator_and_other_threads_alone():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    drawn_elsewhere = []
    with skip_random_init():
        nn.Linear(64, 64)
        nn.Embedding(64, 8)
        assert torch.equal(torch.get_rng_state(), before)
        # A torch function mode holds for its own thread: another one draws as usual.
        thread = threading.Thread(target=lambda: drawn_elsewhere.append(nn.Linear(64, 64)))
        thread.start()
        thread.join()
    assert not torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(0)
    assert torch.equal(drawn_elsewhere[0].weight, nn.Linear(64, 64).weight)


def test_building_deepseek_v41_does_not_import_dynamo(tmp_path):
    """On the meta device nn.Embedding's normal_ runs torch._refs, whose first call imports
    torch._dynamo: ~1 s of a process's first V4.1 load that skipping the draw avoids. A fresh
    process, as any earlier test may have imported it."""
    script = f"""
import sys
from pathlib import Path
import torch
from deepwell.engine.layers.torch_paged import TorchPagedAttention
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint
from deepwell.engine.models.loader import load_checkpoint
from deepwell.engine.models.registry import ModelOptions, build_model
path = write_tiny_checkpoint(Path({str(tmp_path)!r}), seed=0).path
assert "torch._dynamo" not in sys.modules, "imported before the build"
build_model(load_checkpoint(str(path)), ModelOptions(torch.bfloat16, TorchPagedAttention))
print("torch._dynamo" in sys.modules)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False", result.stdout + result.stderr
