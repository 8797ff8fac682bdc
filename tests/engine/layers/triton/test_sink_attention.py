"""The Triton sink attention against TorchSinkAttention, through Triton's interpreter."""

import pytest
import torch

from deepwell.engine.layers.sink_attention import TorchSinkAttention
from deepwell.engine.layers.triton.sink_attention import TritonSinkAttention, sink_attention


def case(rows, heads, dim, keys, selected, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator)

    visible = torch.rand(rows, keys, generator=generator) < 0.7
    picked = valid = None
    if selected:
        picked = draw(rows, selected, dim)
        valid = torch.rand(rows, selected, generator=generator) < 0.6
    return draw(rows, heads, dim), draw(keys, dim), visible, picked, valid, draw(heads)


@pytest.mark.parametrize(
    "rows, heads, dim, keys, selected",
    [(3, 4, 32, 8, 4), (5, 4, 32, 40, 70), (2, 20, 24, 7, 0), (1, 4, 32, 33, 1)],
)
def test_matches_the_torch_backend(rows, heads, dim, keys, selected) -> None:
    inputs = case(rows, heads, dim, keys, selected)
    expected = TorchSinkAttention(heads, dim, 8, 4).forward(*inputs)
    got = TritonSinkAttention(heads, dim, 8, 4).forward(*inputs)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_query_that_sees_nothing_gives_zeros() -> None:
    q, keys, visible, picked, valid, sinks = case(2, 4, 32, 8, 4)
    visible[0] = False
    valid[0] = False
    out = sink_attention(q, keys, visible, picked, valid, sinks, 32**-0.5)
    assert torch.equal(out[0], torch.zeros(4, 32))
    assert out[1].abs().sum() > 0


def test_bfloat16_inputs_answer_in_bfloat16() -> None:
    inputs = list(case(3, 4, 32, 16, 8))
    for index in (0, 1, 3):
        inputs[index] = inputs[index].bfloat16()
    expected = TorchSinkAttention(4, 32, 8, 4).forward(*inputs)
    got = TritonSinkAttention(4, 32, 8, 4).forward(*inputs)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


def test_mismatched_keys_are_refused_by_name() -> None:
    q, keys, visible, picked, valid, sinks = case(2, 4, 32, 8, 4)
    with pytest.raises(ValueError, match="window_visible"):
        sink_attention(q, keys, visible[:, :5], picked, valid, sinks, 1.0)
