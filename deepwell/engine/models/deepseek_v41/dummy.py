"""Synthetic weights of a DeepSeek-V4.1 checkpoint's shapes and released encodings, from its
config.json alone: DeepInfer's `load_format="dummy"` (spec/deepinfer.md §1.3), for benchmarks."""

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.models.deepseek_v41.schema import (
    ARCHITECTURE,
    is_deepseek_v41_config,
    tensor_schema,
)
from deepwell.engine.models.deepseek_v41.weight_formats import WeightFormat, quantize
from deepwell.engine.models.deepseek_v41.writer import random_mxfp4, random_weight
from deepwell.engine.models.loader import Checkpoint


def dummy_checkpoint(path: str | Path, seed: int = 0) -> Checkpoint:
    """The Checkpoint `load_v41_checkpoint` would map, its tensors drawn at random (seeded)
    in their stored encodings; no .safetensors file is read. The tokenizer beside the
    config is read if there is one (Engram hashes through it)."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"load_format 'dummy' needs {str(config_path)!r}")
    config = json.loads(config_path.read_text())
    if not is_deepseek_v41_config(config):
        raise ModelLoadError(
            f"load_format 'dummy' draws DeepSeek-V4.1 weights (DeepInfer's one model); "
            f"{str(config_path)!r} is not a V4.1 config"
        )
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for spec in tensor_schema(config.get("text_config", config)).values():
        if spec.format is WeightFormat.MXFP4:
            data, scale = random_mxfp4(spec, generator)
        else:
            data, scale = quantize(spec.format, random_weight(spec, generator))
        tensors[spec.name] = data
        if spec.scale_name is not None:
            tensors[spec.scale_name] = scale
    tokenizer_path = path / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_path)) if tokenizer_path.is_file() else None
    return Checkpoint(path, ARCHITECTURE, config, tensors, tokenizer, None)
