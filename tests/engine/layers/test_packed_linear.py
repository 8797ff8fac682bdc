"""Packed bf16 linears: F.linear's results at any row count (its bits on SmolLM2's projections
where oneDNN runs them above the panel kernel's rows; on AMX tiles each row's own bits), used
wherever they can run (bf16 on CPU), outside batch-invariant mode."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.layers.amx_linear import amx_kernel_ready, linears_on_tiles
from deepwell.engine.layers.batch_invariant import AmxTileLinear, RowwiseLinear
from deepwell.engine.layers.bf16_gemm import MAX_ROWS
from deepwell.engine.layers.float32_head import Float32Head
from deepwell.engine.layers.fused_glue import kernel_glue
from deepwell.engine.layers.packed_linear import (
    PackedLinear,
    SiluGateUpLinear,
    can_pack,
    fuse_gate_up,
    pack_linears,
)

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
    linear = model[0]
    assert type(linear) is PackedLinear
    for rows in (1, 2, 3, 7, 8, 63, 64, 65, 231, 1024, 2049):
        x = torch.randn(rows, features[0]).to(torch.bfloat16)
        expected = F.linear(x, weight, bias)
        if exact and linear.tiles is None and (linear.panels is None or rows > MAX_ROWS):
            # The kernel F.linear runs for these shapes, without re-packing per call.
            assert torch.equal(linear(x), expected), rows
        elif exact:
            # AMX tiles (test_amx_linear.py) or the panel kernel's rows (test_bf16_gemm.py):
            # another accumulation order, whose bits may differ in the last place.
            torch.testing.assert_close(linear(x), expected, rtol=1e-2, atol=1e-2)
        else:
            torch.testing.assert_close(linear(x), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not linears_on_tiles(), reason="no AMX tiles for oneDNN or amx_linear.cpp")
def test_on_amx_tiles_a_rows_result_is_its_own_whatever_the_rows_beside_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1536, 576)).to(torch.bfloat16)
    pack_linears(model)
    linear = model[0]
    assert linear.tiles is not None and linear.packed_weight is None and linear.panels is None
    x = torch.randn(3, 70, 1536).to(torch.bfloat16)
    whole = linear(x)
    assert whole.shape == (3, 70, 576)
    for rows in (slice(0, 1), slice(5, 21), slice(20, 57)):
        assert torch.equal(linear(x[1, rows]), whole[1, rows])


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
    gate_ups = [layer.mlp.gate_up_proj for layer in model.layers]
    others = [m for m in model.layers.modules() if isinstance(m, nn.Linear) and m not in gate_ups]
    assert others and all(type(m) is expected for m in others)
    # The default mode's bf16 gate_up computes the MLP's activation where it is on AMX tiles.
    fused = expected is PackedLinear and linears_on_tiles()
    assert all(type(m) is (SiluGateUpLinear if fused else expected) for m in gate_ups)
    # A bf16 head gives float32 sums, batch invariant in either mode.
    head = Float32Head if kwargs["dtype"] == "bfloat16" else nn.Linear
    assert type(model.lm_head) is head


@pytest.mark.skipif(not linears_on_tiles(), reason="no AMX tiles for amx_linear.cpp")
def test_a_fused_gate_up_gives_the_bits_of_the_linear_and_the_glues_silu_mul():
    glue = kernel_glue()
    assert glue is not None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(576, 2 * 1536, bias=False)).to(torch.bfloat16)
    pack_linears(model)
    linear = model[0]
    x = torch.randn(1035, 576).to(torch.bfloat16)
    # Whole chunks and partial ones, a decode step's rows and a prompt chunk's.
    expected = {rows: glue.silu_mul(linear(x[:rows])) for rows in (1, 17, 56, 1035)}
    whole_outputs = {rows: linear(x[:rows]) for rows in expected}
    assert fuse_gate_up(linear) and type(linear) is SiluGateUpLinear
    for rows, act in expected.items():
        assert torch.equal(linear.silu_mul(x[:rows]), act), rows
        # Called as a linear it still gives [gate | up] in the weight's order.
        assert torch.equal(linear(x[:rows]), whole_outputs[rows]), rows
    assert linear.silu_mul(x.view(5, 207, 576)).shape == (5, 207, 1536)


@pytest.mark.skipif(not linears_on_tiles(), reason="no AMX tiles for amx_linear.cpp")
@pytest.mark.parametrize(
    ("features", "bias"), [((576, 2 * 1536), True), ((576, 2 * 40), False)], ids=["bias", "odd"]
)
def test_a_gate_up_with_a_bias_or_an_intermediate_off_the_tiles_stays_a_linear(features, bias):
    model = nn.Sequential(nn.Linear(*features, bias=bias)).to(torch.bfloat16)
    pack_linears(model)
    assert not fuse_gate_up(model[0]) and type(model[0]) is PackedLinear
    assert not fuse_gate_up(nn.Linear(8, 32))
