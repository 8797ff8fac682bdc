"""The batch-invariant bf16 linear on AMX tiles (amx_linear.cpp): each row's bits its own
whatever the row count and the rows beside it, within float32 accumulation error of the exact
product, the tile layout tdpbf16ps reads, and no build where AMX cannot run."""

import platform

import pytest
import torch

from deepwell.engine.layers import decode_kernel
from deepwell.engine.layers.amx_linear import amx_kernel_ready, amx_linear, tile_layout

needs_amx = pytest.mark.skipif(
    not amx_kernel_ready(),
    reason="the AMX linear does not run here (no AMX bf16 tiles, or torch below AVX-512)",
)
ROW_COUNTS = (1, 3, 16, 17, 64, 300)


def exact_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """float64 x @ weight.T (+ bias) and how far a float32 sum of its products plus the bias,
    rounded once to bf16, may be from it: in · 2^-24 · Σ|x·w| for the sum, half a bf16 ulp
    for the store."""
    x64, w64 = x.double(), weight.double()
    exact = x64 @ w64.T + (0 if bias is None else bias.double())
    magnitude = x64.abs() @ w64.abs().T + (0 if bias is None else bias.double().abs())
    accumulation = x.shape[1] * 2.0**-24 * magnitude
    return exact, accumulation + (exact.abs() + accumulation) * 2.0**-8


def test_the_tile_layout_puts_an_input_pair_of_16_outputs_in_one_tile_row():
    weight = torch.arange(40 * 70, dtype=torch.float32).view(40, 70).bfloat16()
    tiles = tile_layout(weight)
    assert tiles.shape == (3, 3, 16, 16, 2)
    # Output 16 * t + o, input 32 * b + 2 * p + e.
    for t, b, p, o, e in [(0, 0, 0, 0, 0), (1, 2, 2, 7, 1), (2, 1, 15, 7, 1)]:
        assert tiles[t, b, p, o, e] == weight[16 * t + o, 32 * b + 2 * p + e]
    # Past the weight's 40 outputs and 70 inputs: zeros.
    assert not tiles[2, :, :, 8:].any() and not tiles[:, 2, 3:].any()


@needs_amx
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (70, 40)])
def test_each_row_has_the_same_bits_whatever_the_rows_beside_it(in_features, out_features, threads):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    tiles = tile_layout(weight)
    rows = torch.randn(300, in_features, generator=generator).bfloat16()
    whole = amx_linear(rows, tiles, None, out_features)
    for count in ROW_COUNTS:
        for first in (0, 5, 300 - count):
            part = amx_linear(rows[first : first + count], tiles, None, out_features)
            assert torch.equal(part, whole[first : first + count]), (count, first)
    # At one thread as at two: threads split the outputs, never a sum.
    before = torch.get_num_threads()
    torch.set_num_threads(3 - threads)
    try:
        assert torch.equal(amx_linear(rows, tiles, None, out_features), whole)
    finally:
        torch.set_num_threads(before)
    # A row among others in another order: its own bits still.
    shuffled = amx_linear(rows.flip(0)[:17], tiles, None, out_features)
    assert torch.equal(shuffled, whole.flip(0)[:17])


@needs_amx
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_the_product_is_within_float32_accumulation_error(rows, bias, threads):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(49, 1000, generator=generator).bfloat16()
    x = torch.randn(rows, 1000, generator=generator).bfloat16()
    b = torch.randn(49, generator=generator).bfloat16() if bias else None
    out = amx_linear(x, tile_layout(weight), b, 49)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 49)
    exact, bound = exact_bound(x, weight, b)
    assert ((out.double() - exact).abs() <= bound).all()


@needs_amx
@pytest.mark.parametrize("float32_out", [False, True], ids=["bf16", "float32"])
@pytest.mark.parametrize("out_features", [16384, 16390], ids=["whole-vectors", "a-partial-one"])
def test_an_output_past_the_caches_has_the_bits_of_small_calls(out_features, float32_out, threads):
    # 144 rows x 16,384 outputs (4.5 MiB in bf16) are stored past the caches (non-temporal
    # stores); 8 rows are not: the sums, the bias and the partial last vector are the same.
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 96, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(144, 96, generator=generator).bfloat16()
    tiles = tile_layout(weight)
    whole = amx_linear(x, tiles, bias, out_features, float32_out)
    assert whole.numel() * whole.element_size() >= 4 << 20
    parts = [
        amx_linear(x[i : i + 8], tiles, bias, out_features, float32_out) for i in range(0, 144, 8)
    ]
    assert torch.equal(whole, torch.cat(parts))
    exact, bound = exact_bound(x, weight, bias)
    assert ((whole.double() - exact).abs() <= bound).all()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86's instruction sets")
def test_nothing_is_built_below_torchs_avx512_level(monkeypatch):
    # ATEN_CPU_CAPABILITY=avx2 on an AMX Xeon: the row-wise kernel serves, as on AVX2 CPUs.
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_tile": True, "amx_bf16": True})
    assert "below AVX-512" in decode_kernel.amx_tiles_lacking()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_tile": False})
    assert "no AMX" in decode_kernel.amx_tiles_lacking()
