"""The Triton grouped MXFP4 expert GEMM against blockscaled's torch reference, through
Triton's interpreter."""

import pytest
import torch

from deepwell.engine.layers.blockscaled import MxFp4Experts, mxfp4_experts_reference
from deepwell.engine.layers.triton.mxfp4_experts import mxfp4_expert_gemm
from deepwell.engine.models.deepseek_v41.weight_formats import quantize_mxfp4

LIMIT = 7.0


def bank(experts: int, hidden: int, intermediate: int, seed: int) -> MxFp4Experts:
    """Each matrix quantised from its own random values, rows scaled apart so that the
    rows' E8M0 scales differ."""
    generator = torch.Generator().manual_seed(seed)
    parts: dict[str, list] = {k: [] for k in ("w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale")}
    for _ in range(experts):
        for name, shape in (
            ("w1", (intermediate, hidden)),
            ("w3", (intermediate, hidden)),
            ("w2", (hidden, intermediate)),
        ):
            spread = torch.exp2(torch.randint(-3, 4, (shape[0], 1), generator=generator).float())
            data, scale = quantize_mxfp4(torch.randn(shape, generator=generator) * 0.1 * spread)
            parts[name].append(data)
            parts[f"{name}_scale"].append(scale)
    return MxFp4Experts.from_tensors(**parts)


@pytest.mark.parametrize(
    "hidden, intermediate, pairs, dtype",
    [
        (64, 32, 1, torch.bfloat16),
        (64, 32, 11, torch.float32),
        (70, 48, 40, torch.bfloat16),
        (200, 160, 70, torch.float32),
    ],
)
def test_matches_the_torch_reference(hidden, intermediate, pairs, dtype) -> None:
    """6 experts, the pairs in random order over slots 0, 2, 4 and 5 (1 and 3 idle); inputs
    large enough that the limit clamps some gates."""
    experts = bank(6, hidden, intermediate, seed=hidden + intermediate)
    generator = torch.Generator().manual_seed(pairs)
    slots = torch.tensor([0, 5, 2, 4])[torch.randint(0, 4, (pairs,), generator=generator)]
    weights = torch.rand(pairs, generator=generator) + 0.1
    x = (torch.randn(pairs, hidden, generator=generator) * 4).to(dtype)
    expected = mxfp4_experts_reference(x, slots, weights, experts, LIMIT)
    got = mxfp4_expert_gemm(x, slots, weights, experts, LIMIT)
    # Summation order differs: errors relative to the outputs' scale, where sums cancel.
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * expected.abs().max())


def test_no_pairs_give_no_rows() -> None:
    experts = bank(2, 64, 32, seed=0)
    x = torch.empty(0, 64)
    out = mxfp4_expert_gemm(x, torch.empty(0, dtype=torch.int64), torch.empty(0), experts, LIMIT)
    assert out.shape == (0, 64)


def test_a_slot_outside_the_bank_leaves_its_row_zero() -> None:
    experts = bank(2, 64, 32, seed=0)
    x = torch.randn(3, 64)
    out = mxfp4_expert_gemm(x, torch.tensor([1, 2, -1]), torch.ones(3), experts, LIMIT)
    assert out[0].abs().sum() > 0
    assert torch.equal(out[1:], torch.zeros(2, 64))


def test_wrong_slots_dtype_is_refused_by_name() -> None:
    experts = bank(2, 64, 32, seed=0)
    with pytest.raises(ValueError, match="slots must be int64"):
        mxfp4_expert_gemm(
            torch.randn(2, 64), torch.tensor([0, 1]).int(), torch.ones(2), experts, 1.0
        )
