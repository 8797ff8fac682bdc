"""The plain-array GGUF reader parses every field and tensor as gguf's own reader does."""

import struct

import gguf
import numpy as np

from deepwell.engine.models.gguf_reader import PlainArrayGGUFReader
from deepwell.engine.models.gguf_tokenizer import build_tokenizer
from deepwell.engine.models.loader import embedded_model_path


def assert_same_reading(path) -> None:
    """Fields (offsets, parts as views: dtype, shape, bytes; data indices, types, contents)
    and tensors, to the byte."""
    reference, fast = gguf.GGUFReader(path), PlainArrayGGUFReader(path)
    assert list(fast.fields) == list(reference.fields)
    for key, expected in reference.fields.items():
        field = fast.fields[key]
        assert (field.offset, field.name, field.data) == (
            expected.offset,
            expected.name,
            expected.data,
        ), key
        assert field.types == expected.types, key
        assert len(field.parts) == len(expected.parts), key
        for part, expected_part in zip(field.parts, expected.parts, strict=True):
            assert part.dtype == expected_part.dtype, key
            assert part.shape == expected_part.shape, key
            assert part.tobytes() == expected_part.tobytes(), key
        assert field.contents() == expected.contents(), key
    assert fast.data_offset == reference.data_offset
    assert len(fast.tensors) == len(reference.tensors)
    for tensor, expected in zip(fast.tensors, reference.tensors, strict=True):
        assert (tensor.name, tensor.tensor_type, tensor.data_offset, tensor.n_bytes) == (
            expected.name,
            expected.tensor_type,
            expected.data_offset,
            expected.n_bytes,
        )
        assert np.array_equal(tensor.shape, expected.shape)
        assert np.array_equal(tensor.data, expected.data)


def test_embedded_gguf_reads_field_for_field_as_ggufs_reader():
    assert_same_reading(embedded_model_path())


def test_edge_case_arrays_read_as_ggufs_reader(tmp_path):
    """Empty strings, multi-byte UTF-8, scalar item types, nested arrays (gguf's writer
    refuses empty arrays: see the next test)."""
    path = tmp_path / "edges.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("test.strings", ["", "a", "naïve café", "日本語", "🎉", " " * 300])
    writer.add_array("test.ints", list(range(-5, 300)))
    writer.add_array("test.floats", [0.5, -1.25, 3e38])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.nested", [[1, 2], ["x", "yz"]])
    writer.add_key_value(
        "test.u8s", [1, 2, 255], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8
    )
    writer.add_key_value(
        "test.i64s", [-(2**62), 7], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT64
    )
    writer.add_string("test.string", "after the arrays")
    writer.add_uint32("test.scalar", 7)
    writer.add_tensor("weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_reading(path)
    assert PlainArrayGGUFReader(path).fields["test.strings"].contents()[2] == "naïve café"


def test_empty_arrays_read_as_ggufs_reader(tmp_path):
    """An empty array names no item type in gguf's reading (it takes it from the first item);
    written by hand, as gguf's writer refuses them."""

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()

    def empty_array(key: str, item_type: gguf.GGUFValueType) -> bytes:
        return string(key) + struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, item_type, 0)

    path = tmp_path / "empty.gguf"
    path.write_bytes(
        struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, 0, 3)
        + empty_array("test.no_strings", gguf.GGUFValueType.STRING)
        + empty_array("test.no_ints", gguf.GGUFValueType.INT32)
        + string("test.after")
        + struct.pack("<I", gguf.GGUFValueType.STRING)
        + string("still read")
    )
    assert_same_reading(path)
    assert PlainArrayGGUFReader(path).fields["test.after"].contents() == "still read"


def test_the_tokenizer_built_from_either_reading_is_the_same():
    """The embedded vocabulary, merges and token types as read fast make the tokenizer
    gguf's own reading makes: the same serialised tokenizer, the same ids for varied text
    and special tokens."""

    def tokenizer_of(reader):
        def field(key):
            return reader.fields[key].contents()

        return build_tokenizer(
            field("tokenizer.ggml.model"),
            field("tokenizer.ggml.pre"),
            field("tokenizer.ggml.tokens"),
            field("tokenizer.ggml.merges"),
            field("tokenizer.ggml.token_type"),
        )

    path = embedded_model_path()
    fast, reference = tokenizer_of(PlainArrayGGUFReader(path)), tokenizer_of(gguf.GGUFReader(path))
    assert fast.to_str() == reference.to_str()
    text = "<|im_start|>user\nNaïve café, 日本語 12345 🎉\tdef f(x): return x<|im_end|>"
    assert fast.encode(text).ids == reference.encode(text).ids
    assert fast.encode("<|endoftext|>").ids == [0]
