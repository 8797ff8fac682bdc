"""The fused glue (llama_glue.cpp) against the torch ops it replaces: residual add + RMSNorm
and silu(gate) * up, float32 and bf16, odd widths, row counts across the parallel grain; a
row's result independent of its neighbours; the register passes' exact bits (at torch's
level and forced to AVX2); and which glue a model gets per backend."""

import platform

import numpy as np
import pytest
import torch

from deepwell.engine.layers.batch_invariant import BatchInvariantAttention
from deepwell.engine.layers.cpp_paged import CppPagedAttention
from deepwell.engine.layers.fused_glue import KernelGlue, TorchGlue, kernel_glue
from deepwell.engine.layers.torch_paged import TorchPagedAttention
from deepwell.engine.models.llama import LlamaConfig, LlamaForCausalLM

from .avx2_rerun import rerun_at_avx2

# float32 results: the kernel and torch sum a row's squares in different orders.
FLOAT_RTOL = 2e-6


@pytest.fixture(scope="module", autouse=True)
def glue():
    """Skips only where the decode kernel cannot build (no compiler, as its own tests)."""
    loaded = kernel_glue()
    if loaded is None:
        pytest.skip("the decode kernel (and its glue ops) is unavailable")
    return loaded


def within_one_bf16_ulp(got: torch.Tensor, want: torch.Tensor) -> bool:
    """bf16 values at most one unit in the last place apart (neighbouring bit patterns)."""
    a = got.view(torch.int16).int()
    b = want.view(torch.int16).int()
    return bool(((a - b).abs() <= 1).all())


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("width", [576, 100])
@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_torch(rows, width, delta_dtype, out_dtype):
    gen = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, width, generator=gen) * 3
    delta = None
    if delta_dtype is not None:
        delta = torch.randn(rows, width, generator=gen).to(delta_dtype)
    weight = 1 + 0.1 * torch.randn(width, generator=gen)
    want_x, want = TorchGlue.add_rms_norm(x, delta, weight, 1e-5, out_dtype)
    got_x, got = KernelGlue.add_rms_norm(x.clone(), delta, weight, 1e-5, out_dtype)
    # The add is one exact-as-float32 sum per element on both paths.
    assert torch.equal(got_x, want_x)
    assert got.dtype == out_dtype
    if out_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=FLOAT_RTOL, atol=1e-7)
    else:
        assert within_one_bf16_ulp(got, want)


def test_add_rms_norm_updates_the_residual_in_place():
    x = torch.randn(5, 64)
    delta = torch.randn(5, 64)
    expected = x + delta
    residual, _ = KernelGlue.add_rms_norm(x, delta, torch.ones(64), 1e-6, torch.float32)
    assert residual is x
    assert torch.equal(x, expected)


@pytest.mark.parametrize("rows", [1, 9, 200])
@pytest.mark.parametrize("width", [1536, 37])
def test_silu_mul_matches_torch_in_float32(rows, width):
    gen = torch.Generator().manual_seed(rows + width)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 4
    got = KernelGlue.silu_mul(gate_up)
    want = TorchGlue.silu_mul(gate_up)
    torch.testing.assert_close(got, want, rtol=FLOAT_RTOL, atol=1e-7)


@pytest.mark.parametrize("rows", [1, 9, 200])
def test_silu_mul_in_bf16_is_within_one_ulp_of_torch(rows):
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).bfloat16()
    got = KernelGlue.silu_mul(gate_up)
    # torch rounds silu's output to bf16 before the product, the kernel only the product:
    # the float32 product of the exact values is the reference both are rounded from.
    gate, up = gate_up.float().chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up
    assert got.dtype == torch.bfloat16
    assert within_one_bf16_ulp(got, exact.bfloat16())


def test_silu_mul_saturates_like_silu_at_extremes():
    gate = torch.tensor([[-1e4, -100.0, -88.5, 0.0, 88.5, 100.0, 1e4]])
    gate_up = torch.cat((gate, torch.ones_like(gate)), dim=1)
    got = KernelGlue.silu_mul(gate_up)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate), rtol=FLOAT_RTOL, atol=1e-7)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_glue_does_not_depend_on_its_neighbours(dtype):
    """Batch invariance: one row alone, and the same row among 300 (split across threads),
    give the same bits."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 576, generator=gen)
    delta = torch.randn(300, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen)
    _, many = KernelGlue.add_rms_norm(x.clone(), delta, weight, 1e-5, dtype)
    _, one = KernelGlue.add_rms_norm(x[123:124].clone(), delta[123:124], weight, 1e-5, dtype)
    assert torch.equal(many[123:124], one)
    gate_up = torch.randn(300, 2 * 1536, generator=gen).to(dtype)
    assert torch.equal(KernelGlue.silu_mul(gate_up)[7:8], KernelGlue.silu_mul(gate_up[7:8]))


def kernel_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """The kernel's RMSNorm of float32 rows, bit for bit, for widths of whole vectors: the
    squares summed in one accumulator of the build's vector (the first square, then a fused
    multiply-add a vector), its lanes folded by halves, then x * inverse * weight."""
    lanes = {"AVX512": 16, "AVX2": 8}[torch.backends.cpu.get_cpu_capability()]
    chunks = x.view(x.shape[0], -1, lanes).double()
    accumulator = chunks[:, 0].square().float()
    for chunk in chunks.unbind(1)[1:]:
        # The float64 sum of the exact product, rounded to float32: a fused multiply-add
        # (a double rounding could differ, about once in 2**29 sums).
        accumulator = (chunk.square() + accumulator.double()).float()
    step = lanes // 2
    while step:
        accumulator = accumulator + accumulator[:, torch.arange(lanes) ^ step]
        step //= 2
    total = accumulator[:, 0].numpy()
    width, epsilon = np.float32(x.shape[1]), np.float32(eps)
    inverse = np.float32(1) / np.sqrt(total / width + epsilon)
    return (x * torch.from_numpy(inverse)[:, None] * weight).to(dtype)


@pytest.mark.parametrize("rows", [1, 55, 300])
@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_of_whole_vector_rows_has_the_kernels_exact_bits(rows, delta_dtype, out_dtype):
    gen = torch.Generator().manual_seed(rows)
    width = 576
    x = torch.randn(rows, width, generator=gen) * 3
    delta = None
    if delta_dtype is not None:
        delta = torch.randn(rows, width, generator=gen).to(delta_dtype)
    weight = 1 + 0.1 * torch.randn(width, generator=gen)
    residual = x if delta is None else x + delta.float()
    got_x, got = KernelGlue.add_rms_norm(x.clone(), delta, weight, 1e-5, out_dtype)
    assert torch.equal(got_x, residual)
    assert torch.equal(got, kernel_rms_norm(residual, weight, 1e-5, out_dtype))


def test_silu_mul_of_whole_vector_rows_matches_the_scratch_pass_bit_for_bit():
    """Rows of 1,536 (whole vector pairs) take the register pass (on AVX-512 builds), rows
    of 1,537 the scratch pass: the same values give the same bits, NaN, inf and saturating
    gates included."""
    gen = torch.Generator().manual_seed(5)
    # Enough values that a reordered product (a float ulp) shows through the bf16 rounding.
    rows, width = 1000, 1536
    gate_up = torch.randn(rows, 2, width, generator=gen) * 6
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 88.7, -88.7, -1e4, 0.0])
    where = torch.rand(gate_up.shape, generator=gen) < 0.05
    picks = specials[torch.randint(0, len(specials), gate_up.shape, generator=gen)]
    gate_up = torch.where(where, picks, gate_up).bfloat16()
    wider = torch.cat((gate_up, torch.ones(rows, 2, 1, dtype=torch.bfloat16)), dim=2)
    got = KernelGlue.silu_mul(gate_up.view(rows, -1))
    scratch = KernelGlue.silu_mul(wider.view(rows, -1))[:, :width]
    assert torch.equal(got.view(torch.int16), scratch.view(torch.int16))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's AVX2 level")
def test_the_register_passes_keep_their_bits_with_torch_forced_to_avx2():
    """The exact-bits checks in a process whose torch (and so the kernel's build) runs at
    AVX2: vectors of 8 lanes, another fold."""
    run = rerun_at_avx2(__file__, "exact_bits or bit_for_bit")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


def test_bad_input_is_a_clear_error():
    with pytest.raises(RuntimeError, match="residual must be a contiguous float32"):
        KernelGlue.add_rms_norm(
            torch.ones(2, 8).bfloat16(), None, torch.ones(8), 1e-6, torch.float32
        )
    with pytest.raises(RuntimeError, match="weight must be"):
        KernelGlue.add_rms_norm(torch.ones(2, 8), None, torch.ones(4), 1e-6, torch.float32)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        KernelGlue.silu_mul(torch.ones(2, 7))


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        (CppPagedAttention, KernelGlue),
        (TorchPagedAttention, TorchGlue),
        # Its rows are computed alone, so batch invariant as the torch ops are.
        (BatchInvariantAttention, KernelGlue),
    ],
)
def test_the_fused_glue_rides_with_the_cpp_and_batch_invariant_backends(backend, expected):
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_ids=(0,),
    )
    model = LlamaForCausalLM(config, backend, torch.float32)
    assert model.glue is expected
    assert model.layers[0].mlp.glue is expected
