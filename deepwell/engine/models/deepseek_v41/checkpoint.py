"""Map a released DeepSeek-V4.1 checkpoint directory: its tensors as stored, by released name.

Shards are mapped one at a time and every tensor is checked against the schema; each stays
in its released encoding (spec §3.8), a view of the mapped file (safetensors_map.py), its
`.scale` beside it under the scale's own name (the two may sit in different shards). The
model binds them (binding.py). Bad input is a ModelLoadError naming the tensor and file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.models.deepseek_v41.config import DeepseekV41Config
from deepwell.engine.models.deepseek_v41.safetensors_map import MappedShard, ShardFormatError
from deepwell.engine.models.deepseek_v41.schema import (
    ARCHITECTURE,
    TensorSpec,
    tensor_schema,
    vision_schema,
)
from deepwell.engine.models.deepseek_v41.weight_formats import dequantize
from deepwell.engine.models.loader import Checkpoint

INDEX_FILE = "model.safetensors.index.json"
# The vision tower's tensors: read when config.json's vision_config has layers, and
# tolerated otherwise (a text-only config over the released files).
VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")

# nemo and spec §3.8 disagree on which unquantised tensors are BF16 and which F32 (the
# head, the compressor); both are full precision for a float32 model, so either is taken.
_PLAIN_DTYPES = ("BF16", "F32")
# A backbone layer's routed expert: with expert parallelism each rank reads only its own.
_ROUTED_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.")


def load_v41_checkpoint(
    path: str | Path, holds_expert: Callable[[int], bool] | None = None
) -> Checkpoint:
    """Read config.json, the index and the tokenizer of a V4.1 directory and map its
    shards: `tensors` holds every stored tensor (weights and `.scale`s) as released.

    With `holds_expert` (expert parallelism) only the backbone's routed experts it holds are
    read, and no draft stage (`mtp.*`, which runs only without expert parallelism)."""
    path = Path(path)
    config = _read_json(path / "config.json")
    schema = _schema(config, path / "config.json")
    index_path = path / INDEX_FILE
    weight_map = _weight_map(index_path)
    stored = _stored_names(schema)
    _check_names(weight_map, stored, index_path)
    by_shard: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if name in stored and _wanted(name, holds_expert):
            by_shard.setdefault(file, []).append(name)
    for file, names in sorted(by_shard.items()):
        if not (path / file).is_file():
            raise ModelLoadError(
                f"shard {str(path / file)!r} is missing (the index puts {names[0]!r} "
                f"and {len(names) - 1} more tensors there)"
            )

    tensors: dict[str, torch.Tensor] = {}
    for file in tqdm(sorted(by_shard), desc=f"mapping {path.name}", unit="shard"):
        tensors |= _map_shard(path / file, by_shard[file], stored)

    tokenizer = _tokenizer(path, config)
    template = None
    template_path = path / "tokenizer_config.json"
    if template_path.is_file():
        template = _read_json(template_path).get("chat_template")
    in_schema_order = (
        name for spec in schema.values() for name in (spec.name, spec.scale_name) if name
    )
    return Checkpoint(
        path,
        ARCHITECTURE,
        config,
        {name: tensors[name] for name in in_schema_order if name in tensors},
        tokenizer,
        template,
    )


def map_vision_tensors(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and the vision tower's tensors alone, as released (an encoder worker's
    whole model); ModelLoadError when the config has no vision tower or a tensor is amiss."""
    path = Path(path)
    config = _read_json(path / "config.json")
    text_config = config.get("text_config")
    if not isinstance(text_config, dict) or "hidden_size" not in text_config:
        raise ModelLoadError(f"{str(path / 'config.json')!r} has no text_config.hidden_size")
    schema = vision_schema(config.get("vision_config") or {}, text_config["hidden_size"])
    if not schema:
        raise ModelLoadError(
            f"{str(path)!r} has no vision tower (its vision_config has no layers): "
            "nothing for an encoder worker to run"
        )
    weight_map = _weight_map(path / INDEX_FILE)
    stored = _stored_names(schema)
    missing = [name for name in stored if name not in weight_map]
    if missing:
        raise ModelLoadError(f"tensor {missing[0]!r} is missing from {str(path / INDEX_FILE)!r}")
    by_shard: dict[str, list[str]] = {}
    for name in stored:
        by_shard.setdefault(weight_map[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in sorted(by_shard.items()):
        tensors |= _map_shard(path / file, names, stored)
    return config, tensors


def _wanted(name: str, holds_expert: Callable[[int], bool] | None) -> bool:
    if holds_expert is None:
        return True
    if name.startswith("mtp."):
        return False
    routed = _ROUTED_EXPERT.match(name)
    return routed is None or holds_expert(int(routed.group(1)))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{str(path)!r} is missing")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{str(path)!r} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ModelLoadError(f"{str(path)!r} should hold a JSON object")
    return value


def _schema(config: dict[str, Any], config_path: Path) -> dict[str, TensorSpec]:
    text_config = config.get("text_config")
    if not isinstance(text_config, dict):
        raise ModelLoadError(f"{str(config_path)!r} has no text_config object")
    try:
        # The layer schedule first: a bad one is named as such, not as missing tensors.
        DeepseekV41Config.from_hf(config)
    except ModelLoadError as error:
        raise ModelLoadError(f"{str(config_path)!r}: {error}") from None
    try:
        # The vision tower's tensors are read when the config has one (layers > 0).
        vision = vision_schema(config.get("vision_config") or {}, text_config["hidden_size"])
        return tensor_schema(text_config) | vision
    except KeyError as error:
        raise ModelLoadError(
            f"{str(config_path)!r}: text_config lacks {error.args[0]!r}"
        ) from error
    except (TypeError, ValueError) as error:
        raise ModelLoadError(f"{str(config_path)!r}: text_config is invalid: {error}") from error


def _weight_map(index_path: Path) -> dict[str, str]:
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(file, str) for file in weight_map.values()
    ):
        raise ModelLoadError(f"{str(index_path)!r} has no weight_map of tensor name → file")
    return weight_map


def _stored_names(schema: dict[str, TensorSpec]) -> dict[str, tuple[TensorSpec, str]]:
    """Stored tensor name → (its spec, "weight" or "scale")."""
    stored = {}
    for spec in schema.values():
        stored[spec.name] = (spec, "weight")
        if spec.scale_name is not None:
            stored[spec.scale_name] = (spec, "scale")
    return stored


def _check_names(
    weight_map: dict[str, str], stored: dict[str, tuple[TensorSpec, str]], index_path: Path
) -> None:
    for name, file in weight_map.items():
        if name not in stored and not name.startswith(VISION_PREFIXES):
            raise ModelLoadError(
                f"unknown tensor {name!r} in {file!r} (listed by {str(index_path)!r}): "
                "not part of a DeepSeek-V4.1 checkpoint with this config"
            )
    for name in stored:
        if name not in weight_map:
            raise ModelLoadError(f"tensor {name!r} is missing from {str(index_path)!r}")


def _map_shard(
    shard: Path, names: list[str], stored: dict[str, tuple[TensorSpec, str]]
) -> dict[str, torch.Tensor]:
    """The named tensors of one shard, each checked against the schema, viewed in place."""
    try:
        mapped = MappedShard(shard)
    except (ShardFormatError, OSError) as error:
        raise ModelLoadError(
            f"cannot read shard {str(shard)!r} (truncated or corrupt?): {error}"
        ) from error
    tensors = {}
    for name in names:
        entry = mapped.entries.get(name)
        if entry is None:
            raise ModelLoadError(
                f"tensor {name!r} is not in {str(shard)!r}, where the index puts it"
            )
        spec, role = stored[name]
        _check_header(name, spec, role, entry.dtype, list(entry.shape), shard)
        tensors[name] = mapped.tensor(name)
    return tensors


def _check_header(
    name: str, spec: TensorSpec, role: str, dtype: str, shape: list[int], shard: Path
) -> None:
    if role == "scale":
        expected_dtypes: tuple[str, ...] = ("F8_E8M0",)
        expected_shape = spec.format.scale_shape(spec.shape)
    else:
        expected_shape = spec.format.stored_shape(spec.shape)
        expected_dtypes = (
            (spec.format.safetensors_dtype,) if spec.format.quantized else _PLAIN_DTYPES
        )
    if dtype not in expected_dtypes:
        raise ModelLoadError(
            f"tensor {name!r} in {str(shard)!r} is {dtype}; a {spec.format.value} {role} "
            f"is stored as {' or '.join(expected_dtypes)}"
        )
    if tuple(shape) != tuple(expected_shape):
        raise ModelLoadError(
            f"tensor {name!r} in {str(shard)!r} has shape {list(shape)}, "
            f"expected {list(expected_shape)} for this config"
        )


def dequantized(
    tensors: dict[str, torch.Tensor], spec: TensorSpec, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """One released tensor of a mapped checkpoint in its logical shape, as `dtype`."""
    weight = tensors[spec.name]
    if not spec.format.quantized:
        return weight.to(dtype)
    try:
        return dequantize(spec.format, weight, tensors[spec.scale_name]).to(dtype)
    except (TypeError, ValueError) as error:  # headers were checked; this is a last guard
        raise ModelLoadError(f"cannot dequantise {spec.name!r}: {error}") from error


def _tokenizer(path: Path, config: dict[str, Any]) -> Tokenizer:
    # Engram hashes tokens through the tokenizer's vocabulary, so V4.1 cannot run without it.
    tokenizer_path = path / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise ModelLoadError(
            f"{str(tokenizer_path)!r} is missing; DeepSeek-V4.1's Engram needs the tokenizer"
        )
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as error:  # tokenizers raises a bare Exception on bad files
        raise ModelLoadError(f"cannot read {str(tokenizer_path)!r}: {error}") from error
    vocab_size = config["text_config"]["vocab_size"]
    if tokenizer.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise ModelLoadError(
            f"{str(tokenizer_path)!r} has {tokenizer.get_vocab_size(with_added_tokens=True)} "
            f"tokens, more than the model's vocab_size {vocab_size}"
        )
    return tokenizer
