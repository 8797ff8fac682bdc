"""The block-scaled kernels (layers/blockscaled.py, blockscaled.cpp) on every instruction-set
path against dequantise-then-matmul in float64 of weights made by weight_formats.quantize_*:
partial blocks, 0 / 1 / several rows, float32 and bfloat16 inputs; every e4m3 and E2M1 code
decoded exactly; experts over pairs in random order with idle experts and the end slots; each
row's bits independent of the rest of the call, a lone row's too; bad input named; the torch
fallback.

Tolerance: the kernels sum each output block by block in their own order (vector lanes, then
a lane sum), not one matmul's order, so results differ from the reference by float32 rounding
only. With exact products, any order of n float32 additions errs by at most γ_n Σ|w x|
(γ_n = n u / (1 - n u), u = 2^-24); the kernels' decoded weights are exact, and with fma or
vdpbf16ps and a per-block scale fma each output takes at most 2n roundings, so the bound used
is γ_2n (|x| @ |W|.T). It is rigorous and still ~1e-4 relative at these widths: a wrong code,
scale, block or lane moves an output by far more.
"""

import logging

import pytest
import torch
import torch.nn.functional as F

from deepwell.engine.layers import blockscaled
from deepwell.engine.layers.blockscaled import (
    MxFp4Experts,
    bf16_linear,
    bf16_linear_reference,
    fp8_block_linear,
    fp8_block_linear_reference,
    mxfp4_experts,
    mxfp4_experts_reference,
)
from deepwell.engine.layers.decode_kernel import load_blockscaled_kernel
from deepwell.engine.models.deepseek_v41.weight_formats import (
    dequantize_fp8_blocks,
    dequantize_mxfp4,
    quantize_fp8_blocks,
    quantize_mxfp4,
)

PATHS = ["native", "avx2", "scalar"]
# (out, in): whole blocks, partial row and column blocks, widths below one block's 64 pairs.
SHAPES = [(64, 64), (48, 64), (64, 48), (33, 70), (96, 200)]
LIMIT = 10.0
U = 2.0**-24


@pytest.fixture(scope="module", params=PATHS)
def kernel(request):
    """Each path built once per machine (cached). Only a machine without a compiler skips; a
    build that fails on one is a failure."""
    loaded = load_blockscaled_kernel(request.param)
    if loaded.module is None and loaded.reason.startswith("no "):
        pytest.skip(f"block-scaled kernel unavailable: {loaded.reason}")
    assert loaded.module is not None, loaded.reason
    if request.param != "native":
        assert loaded.module.instruction_set() in (request.param, "scalar")
    return loaded.module


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def assert_within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    assert out.dtype == torch.float32 and out.shape == ref.shape
    excess = (out.double() - ref).abs() - bound
    assert not (excess > 0).any(), f"worst excess over the bound {excess.max():.3g}"


def fp8_weight(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(out_features, in_features, generator=gen) * 0.05
    dense[:32, :32] *= 300  # one block on a far larger scale than its neighbours
    return quantize_fp8_blocks(dense)


def rows_of(count: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(count, width, generator=gen) * 2).to(dtype)


def linear_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    return gamma(2 * dense.shape[1]) * (x.double().abs() @ dense.double().abs().T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_block_linear_matches_dequantised_matmul(kernel, shape, rows, dtype):
    weight, scale = fp8_weight(*shape, seed=shape[0] + shape[1])
    dense = dequantize_fp8_blocks(weight, scale).double()
    x = rows_of(rows, shape[1], dtype, seed=rows)
    out = kernel.fp8_block_linear(x, weight, scale)
    assert_within(out, x.double() @ dense.T, linear_bound(x, dense))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_e4m3_code_decodes_exactly(kernel, dtype):
    """All 254 finite e4m3 bytes, subnormals included, in a 70-wide matrix (a partial block);
    unit rows pick each column out exactly, once with scale 2^-3 and once with 2^5."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    weight = torch.zeros(4, 70, dtype=torch.uint8)
    weight.view(-1)[: codes.numel()] = codes
    weight = weight.view(torch.float8_e4m3fn)
    scale = torch.tensor([[124, 132, 124]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    x = torch.eye(70, dtype=dtype)
    out = kernel.fp8_block_linear(x, weight, scale)
    assert torch.equal(out, dequantize_fp8_blocks(weight, scale).T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_linear_matches_float_matmul(kernel, shape, rows, dtype):
    gen = torch.Generator().manual_seed(shape[0])
    weight = torch.randn(*shape, generator=gen).bfloat16()
    x = rows_of(rows, shape[1], dtype, seed=rows)
    out = kernel.bf16_linear(x, weight)
    assert_within(out, x.double() @ weight.double().T, linear_bound(x, weight))


@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("shape", SHAPES)
def test_f32_linear_matches_float_matmul(kernel, shape, rows):
    gen = torch.Generator().manual_seed(shape[0])
    weight = torch.randn(*shape, generator=gen)
    x = rows_of(rows, shape[1], torch.float32, seed=rows)
    out = kernel.f32_linear(x, weight)
    assert_within(out, x.double() @ weight.double().T, linear_bound(x, weight))


def expert_tensors(experts: int, hidden: int, intermediate: int, seed: int) -> dict[str, list]:
    """Each matrix quantised from its own random values; rows scaled apart so that every
    expert row has its own e8m0 scales."""
    gen = torch.Generator().manual_seed(seed)
    parts: dict[str, list] = {k: [] for k in ("w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale")}
    for _ in range(experts):
        for name, shape in (
            ("w1", (intermediate, hidden)),
            ("w3", (intermediate, hidden)),
            ("w2", (hidden, intermediate)),
        ):
            spread = torch.exp2(torch.randint(-3, 4, (shape[0], 1), generator=gen).float())
            data, scale = quantize_mxfp4(torch.randn(shape, generator=gen) * 0.1 * spread)
            parts[name].append(data)
            parts[f"{name}_scale"].append(scale)
    return parts


def experts_reference(x, slots, weights, parts) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 expert outputs and their bound: γ over each matmul's additions (2n roundings),
    carried through silu (slope ≤ 1.1) and the clamps (slope ≤ 1), plus 8 u for the float32
    activation arithmetic, then through W2."""
    out = torch.empty(x.shape, dtype=torch.float64)
    bound = torch.empty(x.shape, dtype=torch.float64)
    x = x.double()
    for p in range(x.shape[0]):
        e = int(slots[p])
        w1, w3, w2 = (
            dequantize_mxfp4(parts[n][e], parts[f"{n}_scale"][e]).double()
            for n in ("w1", "w3", "w2")
        )
        h, u = w1 @ x[p], w3 @ x[p]
        eh = gamma(2 * x.shape[1]) * (w1.abs() @ x[p].abs())
        eu = gamma(2 * x.shape[1]) * (w3.abs() @ x[p].abs())
        silu = F.silu(h.clamp(max=LIMIT))
        act = silu * u.clamp(-LIMIT, LIMIT)
        act_error = (
            1.1 * eh * (u.abs() + eu).clamp(max=LIMIT)
            + (silu.abs() + 1.1 * eh) * eu
            + 8 * U * act.abs()
        )
        w = abs(float(weights[p]))
        out[p] = float(weights[p]) * (w2 @ act)
        bound[p] = w * (
            w2.abs() @ act_error + gamma(2 * w2.shape[1]) * (w2.abs() @ (act.abs() + act_error))
        )
    return out, bound


def call_experts(kernel, x, slots, weights, experts: MxFp4Experts) -> torch.Tensor:
    return kernel.mxfp4_experts(
        x, slots, weights, *experts.tables, experts.hidden_size, experts.intermediate_size, LIMIT
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pairs", [0, 1, 11])
@pytest.mark.parametrize("hidden,intermediate", [(64, 48), (96, 32), (70, 70)])
def test_mxfp4_experts_match_dequantised_experts(kernel, hidden, intermediate, pairs, dtype):
    """6 experts; the pairs in random order over slots 0, 2, 4 and 5 (the ends; 1 and 3 idle),
    several pairs sharing an expert; inputs large enough that the limit clamps some gates."""
    parts = expert_tensors(6, hidden, intermediate, seed=hidden + intermediate)
    experts = MxFp4Experts.from_tensors(**parts)
    gen = torch.Generator().manual_seed(pairs)
    slots = torch.tensor([0, 5, 2, 4, 0, 5, 5, 2, 0, 4, 5])[torch.randperm(11, generator=gen)][
        :pairs
    ]
    weights = torch.rand(pairs, generator=gen) + 0.1
    x = rows_of(pairs, hidden, dtype, seed=pairs) * 4
    out = call_experts(kernel, x, slots, weights, experts)
    ref, bound = experts_reference(x, slots, weights, parts)
    if pairs:
        w1 = dequantize_mxfp4(parts["w1"][0], parts["w1_scale"][0])
        assert (x.float() @ w1.T).abs().max() > LIMIT  # the clamp is exercised
    assert_within(out, ref, bound)


def test_rows_are_independent_of_the_call(kernel):
    """Each row's bits are the same computed alone as in a call of 17 (the batch-invariant
    engine relies on it): 17 is more than a register group (4) and not a multiple of it."""
    weight, scale = fp8_weight(96, 200, seed=1)
    dense = torch.randn(96, 200).bfloat16()
    parts = expert_tensors(6, 70, 48, seed=2)
    experts = MxFp4Experts.from_tensors(**parts)
    slots = torch.tensor([0, 5, 5, 2, 5, 0, 4, 5, 5, 5, 2, 0, 4, 5, 3, 5, 1])
    weights = torch.rand(17) + 0.1
    for dtype in (torch.float32, torch.bfloat16):
        x = rows_of(17, 200, dtype, seed=3)
        pairs = rows_of(17, 70, dtype, seed=4)
        batch = (
            kernel.fp8_block_linear(x, weight, scale),
            kernel.bf16_linear(x, dense),
            kernel.f32_linear(x.float(), dense.float()),
            call_experts(kernel, pairs, slots, weights, experts),
        )
        for row in (0, 3, 4, 16):
            alone = (
                kernel.fp8_block_linear(x[row : row + 1], weight, scale),
                kernel.bf16_linear(x[row : row + 1], dense),
                kernel.f32_linear(x[row : row + 1].float(), dense.float()),
                call_experts(
                    kernel,
                    pairs[row : row + 1],
                    slots[row : row + 1],
                    weights[row : row + 1],
                    experts,
                ),
            )
            for together, single in zip(batch, alone, strict=True):
                assert torch.equal(together[row], single[0])


@pytest.mark.parametrize("shape", [(70, 33), (5, 576), (131, 100)])
def test_a_lone_row_has_its_bits_in_every_call(kernel, shape):
    """A one-row call of bf16_linear and f32_linear (AVX2: several outputs a pass, tails of
    1-3 outputs) gives the row's bits in calls of 5, 17 and 33 rows (the last 32-row chunk
    of 33 is a lone row again): outputs not a multiple of 4, partial column blocks."""
    gen = torch.Generator().manual_seed(shape[0])
    weight = torch.randn(*shape, generator=gen)
    for dense in (weight, weight.bfloat16()):
        linear = kernel.f32_linear if dense.dtype == torch.float32 else kernel.bf16_linear
        x = rows_of(33, shape[1], torch.float32, seed=shape[1])
        for count in (5, 17, 33):
            together = linear(x[:count], dense)
            for row in (0, count - 1):
                assert torch.equal(linear(x[row : row + 1], dense)[0], together[row])


def test_slots_outside_the_experts_are_refused(kernel):
    experts = MxFp4Experts.from_tensors(**expert_tensors(3, 64, 32, seed=5))
    x = torch.randn(2, 64)
    for bad in (3, -1):
        with pytest.raises(RuntimeError, match=f"slot {bad} of pair 1"):
            call_experts(kernel, x, torch.tensor([0, bad]), torch.ones(2), experts)


def test_public_calls_match_the_reference_paths():
    """The module's entry points (native where it builds) and the torch references agree
    within the bound, the references computed slice by slice (REFERENCE_ROWS rows at a time:
    600 outputs are two slices, the second partial)."""
    weight, scale = fp8_weight(600, 70, seed=6)
    dense = dequantize_fp8_blocks(weight, scale)
    head = torch.randn(600, 70).bfloat16()
    x = rows_of(3, 70, torch.bfloat16, seed=7)
    for out in (fp8_block_linear(x, weight, scale), fp8_block_linear_reference(x, weight, scale)):
        assert_within(out, x.double() @ dense.double().T, linear_bound(x, dense))
    for out in (bf16_linear(x, head), bf16_linear_reference(x, head)):
        assert_within(out, x.double() @ head.double().T, linear_bound(x, head))
    parts = expert_tensors(4, 64, 48, seed=8)
    experts = MxFp4Experts.from_tensors(**parts)
    pairs = rows_of(5, 64, torch.float32, seed=9)
    slots, weights = torch.tensor([3, 0, 3, 1, 0]), torch.rand(5)
    ref, bound = experts_reference(pairs, slots, weights, parts)
    for out in (
        mxfp4_experts(pairs, slots, weights, experts, LIMIT),
        mxfp4_experts_reference(pairs, slots, weights, experts, LIMIT),
    ):
        assert_within(out, ref, bound)


def test_without_a_compiler_the_torch_path_runs_and_says_why(monkeypatch, caplog):
    """A missing compiler is logged and the calls still answer (on the torch reference)."""
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    blockscaled.native_kernel.cache_clear()
    load_blockscaled_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="deepwell.engine.layers.blockscaled"):
            weight, scale = fp8_weight(40, 64, seed=10)
            x = torch.randn(2, 64)
            out = fp8_block_linear(x, weight, scale)
        assert "torch reference" in caplog.text and "no C++ compiler" in caplog.text
        assert torch.equal(out, fp8_block_linear_reference(x, weight, scale))
    finally:
        blockscaled.native_kernel.cache_clear()
        load_blockscaled_kernel.cache_clear()


def test_expert_tables_refuse_wrong_tensors():
    parts = expert_tensors(2, 64, 32, seed=11)
    experts = MxFp4Experts.from_tensors(**parts)
    assert (experts.num_experts, experts.hidden_size, experts.intermediate_size) == (2, 64, 32)
    assert experts.tables[0].tolist() == [t.data_ptr() for t in parts["w1"]]
    wrong_dtype = dict(parts, w3=[parts["w3"][0], parts["w3"][1].view(torch.uint8)])
    with pytest.raises(ValueError, match="expert 1 w3: expected torch.int8"):
        MxFp4Experts.from_tensors(**wrong_dtype)
    with pytest.raises(ValueError, match="w2_scale has 1 experts, w1 has 2"):
        MxFp4Experts.from_tensors(**dict(parts, w2_scale=parts["w2_scale"][:1]))
    wrong_shape = dict(parts, w2=[parts["w2"][0], parts["w2"][1][:, :8].contiguous()])
    with pytest.raises(ValueError, match="expert 1 w2: expected"):
        MxFp4Experts.from_tensors(**wrong_shape)


def test_bad_linear_arguments_are_named():
    weight, scale = fp8_weight(64, 64, seed=12)
    with pytest.raises(ValueError, match="x must be \\[rows, 64\\]"):
        fp8_block_linear(torch.randn(2, 63), weight, scale)
    with pytest.raises(ValueError, match="scale must be float8_e8m0fnu \\[2, 2\\]"):
        fp8_block_linear(torch.randn(2, 64), weight, scale[:1])
    with pytest.raises(ValueError, match="weight must be a torch.bfloat16"):
        bf16_linear(torch.randn(2, 64), weight.float())
