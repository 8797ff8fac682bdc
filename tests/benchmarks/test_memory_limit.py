"""benchmarks/memory_limit.py: the bytes a decode step reads, the share of the bandwidth, and
the embedded GGUF's bytes as llama.cpp reads them."""

import memory_limit
import pytest
import torch
from memory_limit import DecodeAtLimit
from torch import nn


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.layer = nn.Linear(16, 32, bias=False)
        self.head = nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_head_is_read_once_and_the_embedding_table_not_at_all():
    model = TiedModel().to(torch.bfloat16)
    assert memory_limit.decode_weight_bytes(model) == (16 * 32 + 16 * 100) * 2


def test_a_linear_on_blocks_counts_its_kernel_layout_not_its_dense_weight():
    model = TiedModel()
    model.layer.register_buffer("quant_weight", torch.zeros(2, 100, dtype=torch.uint8))
    assert memory_limit.decode_weight_bytes(model) == 200 + 16 * 100 * 4


def test_the_fraction_is_bytes_times_tokens_over_bandwidth():
    row = DecodeAtLimit(
        "deepwell int4", tok_s=200.0, weight_bytes=100_000_000, bandwidth_bytes_s=25e9
    )
    assert row.fraction == pytest.approx(0.8)
    assert (
        memory_limit.verdict(row)
        == "memory-limit fraction, deepwell int4: 0.80 (goal >= 85%: missed)"
    )


def test_the_embedded_gguf_holds_what_a_q4_1_smollm2_should():
    from deepwell.engine.models.loader import embedded_model_path

    size = memory_limit.gguf_bytes(embedded_model_path())
    # 135M weights at Q4_1's 0.625 and Q8_0's 1.0625 bytes: about 96 MB, under the file.
    assert 80e6 < size < embedded_model_path().stat().st_size
