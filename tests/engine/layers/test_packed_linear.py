"""Packed bf16 linears: F.linear's results (its bits on SmolLM2's projections above the panel
kernel's rows) at any row count, used wherever they can run (bf16 on CPU), outside
batch-invariant mode."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.layers.amx_linear import amx_kernel_ready
from deepwell.engine.layers.batch_invariant import AmxTileLinear, RowwiseLinear
from deepwell.engine.layers.bf16_gemm import MAX_ROWS
from deepwell.engine.layers.float32_head import Float32Head
from deepwell.engine.layers.packed_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(
    not can_pack(torch.empty(0, dtype=torch.bfloat16)), reason="oneDNN bf16 is unavailable"
)


# SmolLM2's projections (qkv, o, gate_up, down) and one small odd shape.
@pytest.mark.parametrize(
    ("features", "exact"),
    [
        ((576, 960), True),
        ((576, 576), True),
        ((576, 3072), True),
        ((1536, 576), True),
        ((960, 40), False),
    ],
)
def test_packed_linear_computes_f_linear_at_any_row_count(features, exact):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(*features, bias=not exact)).to(torch.bfloat16)
    weight, bias = model[0].weight.clone(), model[0].bias
    pack_linears(model)
    assert type(model[0]) is PackedLinear
    for rows in (1, 2, 3, 7, 8, 63, 64, 65, 231, 1024, 2049):
        x = torch.randn(rows, features[0]).to(torch.bfloat16)
        expected = F.linear(x, weight, bias)
        if exact and (model[0].panels is None or rows > MAX_ROWS):
            # The kernel F.linear runs for these shapes, without re-packing per call.
            assert torch.equal(model[0](x), expected), rows
        elif exact:
            # The panel kernel's rows (test_bf16_gemm.py): its bits may differ in the last place.
            torch.testing.assert_close(model[0](x), expected, rtol=1e-2, atol=1e-2)
        else:
            torch.testing.assert_close(model[0](x), expected, rtol=2e-2, atol=2e-2)


def test_float32_linears_stay_plain():
    model = nn.Sequential(nn.Linear(8, 8))
    pack_linears(model)
    assert type(model[0]) is nn.Linear


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"dtype": "bfloat16"}, PackedLinear),
        ({"dtype": "float32"}, nn.Linear),
        # Batch-invariant: AMX tiles where they run, else blockscaled.cpp's row-wise kernel
        # (it builds wherever the tests run).
        ({"dtype": "bfloat16", "batch_invariant": True}, None),
    ],
)
def test_the_core_packs_bf16_linears_and_runs_them_rowwise_when_invariant(
    make_core, kwargs, expected
):
    if expected is None:
        expected = AmxTileLinear if amx_kernel_ready() else RowwiseLinear
    model = make_core(**kwargs).runner.model
    linears = [m for m in model.layers.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is expected for m in linears)
    # A bf16 head gives float32 sums, batch invariant in either mode.
    head = Float32Head if kwargs["dtype"] == "bfloat16" else nn.Linear
    assert type(model.lm_head) is head
