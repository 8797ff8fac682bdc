"""Reading a safetensors shard in place: views where aligned, a copy where not, clear errors."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from deepwell.engine.models.deepseek_v41.safetensors_map import MappedShard, ShardFormatError


def write_raw(path, entries: dict[str, tuple[str, list[int], bytes]], pad: int = 0) -> None:
    """A shard by hand: `pad` spaces of header padding move every offset off alignment."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in entries.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    text = json.dumps(header).encode() + b" " * pad
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_tensors_read_back_as_saved(tmp_path) -> None:
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(4, 2).to(torch.bfloat16),
        "c": torch.randint(-128, 127, (6,), dtype=torch.int8),
        "d": torch.randn(2, 32).to(torch.float8_e4m3fn),
    }
    save_file(tensors, str(tmp_path / "x.safetensors"))
    shard = MappedShard(tmp_path / "x.safetensors")
    for name, tensor in tensors.items():
        got = shard.tensor(name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))


def test_a_misaligned_tensor_is_copied_and_still_right(tmp_path) -> None:
    values = torch.arange(6, dtype=torch.float32)
    for pad in range(4):  # one of these puts the data at an odd offset
        write_raw(tmp_path / "x.safetensors", {"a": ("F32", [2, 3], values.numpy().tobytes())}, pad)
        assert torch.equal(MappedShard(tmp_path / "x.safetensors").tensor("a"), values.view(2, 3))


def test_a_truncated_shard_is_refused(tmp_path) -> None:
    save_file({"a": torch.randn(64, 64)}, str(tmp_path / "x.safetensors"))
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "x.safetensors").write_bytes(data[:-10])
    with pytest.raises(ShardFormatError, match="truncated"):
        MappedShard(tmp_path / "x.safetensors")


def test_a_byte_count_that_does_not_match_the_shape_is_refused(tmp_path) -> None:
    write_raw(tmp_path / "x.safetensors", {"a": ("F32", [2, 3], b"\0" * 20)})
    with pytest.raises(ShardFormatError, match=r"'a': 20 bytes for a F32 of shape \[2, 3\]"):
        MappedShard(tmp_path / "x.safetensors")
