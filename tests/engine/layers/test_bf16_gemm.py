"""The panel kernel for decode-shaped bf16 linears (bf16_gemm.cpp): within float32
accumulation error of the exact product, each row's result its own whatever the batch, and
PackedLinear's choice of it by row count."""

import pytest
import torch
from torch import nn

from deepwell.engine.layers import bf16_gemm
from deepwell.engine.layers.bf16_gemm import (
    PANEL,
    onednn_uses_amx,
    panel_kernel_ready,
    panel_layout,
    panel_linear,
)
from deepwell.engine.layers.packed_linear import PackedLinear, can_pack, pack_linears

needs_kernel = pytest.mark.skipif(
    not panel_kernel_ready(), reason="the panel kernel needs an AVX512_BF16 build"
)


def exact_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """float64 x @ weight.T (+ bias) and how far a float32 sum of its products, rounded once
    to bf16, may be from it: in · 2^-24 · Σ|x·w| for the sum, half a bf16 ulp for the store."""
    x64, w64 = x.double(), weight.double()
    exact = x64 @ w64.T + (0 if bias is None else bias.double())
    magnitude = x64.abs() @ w64.abs().T + (0 if bias is None else bias.double().abs())
    accumulation = x.shape[1] * 2.0**-24 * magnitude
    return exact, accumulation + (exact.abs() + accumulation) * 2.0**-8


@needs_kernel
@pytest.mark.parametrize(
    ("in_features", "out_features"), [(576, 960), (1536, 576), (64, 40), (96, 33), (2, 1)]
)
@pytest.mark.parametrize("rows", [1, 5, 8, 17, 64])
def test_panel_linear_is_the_product_within_float32_accumulation_error(
    in_features, out_features, rows, threads
):
    torch.manual_seed(rows * 7919 + in_features)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    panels = panel_layout(weight)
    for with_bias in (None, bias):
        exact, bound = exact_bound(x, weight, with_bias)
        out = panel_linear(x, panels, with_bias, out_features)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        assert ((out.double() - exact).abs() <= bound).all()
        # The float32 store is the sum the bf16 one rounds, bit for bit.
        sums = panel_linear(x, panels, with_bias, out_features, float32_out=True)
        assert sums.dtype == torch.float32 and torch.equal(sums.bfloat16(), out)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads(threads):
    torch.manual_seed(1)
    weight = torch.randn(1000, 576).to(torch.bfloat16)
    panels = panel_layout(weight)
    batch = torch.randn(64, 576).to(torch.bfloat16)
    whole = panel_linear(batch, panels, None, 1000)
    for row in (0, 9, 63):
        assert torch.equal(
            panel_linear(batch[row : row + 1], panels, None, 1000), whole[row : row + 1]
        )
    # Rows of a wider tensor (a strided view, as a split leaves them) are read in place.
    wide = torch.randn(64, 700).to(torch.bfloat16)
    wide[:, :576] = batch
    assert torch.equal(panel_linear(wide[:, :576], panels, None, 1000), whole)


def test_panel_layout_puts_each_input_pair_of_32_outputs_side_by_side():
    weight = torch.arange(40 * 6, dtype=torch.float32).view(40, 6).to(torch.bfloat16)
    panels = panel_layout(weight)
    assert panels.shape == (2, 3, PANEL, 2)
    assert torch.equal(panels[1, 2, 3], weight[PANEL + 3, 4:6])
    # Outputs past the last one are zero.
    assert not panels[1, :, 8:].any()


@pytest.mark.parametrize(
    ("isa", "expected"), [("AVX512_CORE_BF16", False), ("AVX512_CORE_AMX", True), (None, True)]
)
def test_onednn_counts_as_amx_only_where_the_cpu_has_tiles_and_its_cap_allows(
    monkeypatch, isa, expected
):
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert onednn_uses_amx() is expected
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert onednn_uses_amx() is False


@needs_kernel
@pytest.mark.skipif(not can_pack(torch.empty(0, dtype=torch.bfloat16)), reason="no oneDNN bf16")
def test_packed_linear_takes_the_panels_up_to_its_row_limit_and_onednn_after(monkeypatch):
    torch.manual_seed(2)
    monkeypatch.setattr(bf16_gemm, "onednn_uses_amx", lambda: False)
    model = nn.Sequential(nn.Linear(576, 960, bias=False)).to(torch.bfloat16)
    pack_linears(model)
    linear = model[0]
    assert type(linear) is PackedLinear and linear.panels is not None
    calls = []
    monkeypatch.setattr(
        "deepwell.engine.layers.packed_linear.panel_linear",
        lambda *args, **kwargs: calls.append(args[0].shape[0]) or panel_linear(*args, **kwargs),
    )
    for rows in (1, bf16_gemm.MAX_ROWS, bf16_gemm.MAX_ROWS + 1):
        x = torch.randn(rows, 576).to(torch.bfloat16)
        exact, bound = exact_bound(x, linear.weight, None)
        assert ((linear(x).double() - exact).abs() <= bound).all()
    assert set(calls) == {1, bf16_gemm.MAX_ROWS}


@pytest.mark.skipif(not can_pack(torch.empty(0, dtype=torch.bfloat16)), reason="no oneDNN bf16")
def test_no_panels_where_onednn_has_amx_tiles(monkeypatch):
    monkeypatch.setattr(bf16_gemm, "onednn_uses_amx", lambda: True)
    model = nn.Sequential(nn.Linear(576, 960, bias=False)).to(torch.bfloat16)
    pack_linears(model)
    assert type(model[0]) is PackedLinear and model[0].panels is None
