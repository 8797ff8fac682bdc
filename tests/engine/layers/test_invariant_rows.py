"""The batch-invariant mode's row-wise pieces (invariant_rows.cpp and `lanewise`): a row's
bits are the same alone, beside any number of rows and at any place among them, and its
values are the plain torch computation's up to float32 rounding."""

import pytest
import torch
import torch.nn.functional as F

from deepwell.engine.layers.batch_invariant import (
    LANEWISE_MAX,
    BatchInvariantSinkAttention,
    lanewise,
    row_kernels,
    row_linear,
)

pytestmark = pytest.mark.skipif(
    not row_kernels(torch.empty(0)), reason="invariant_rows.cpp does not build here"
)

# Row counts around the vector widths and ATen's one-thread limit, and places among them.
COUNTS = (1, 2, 3, 7, 16, 33)
TOTAL = 40


def assert_rows_alone(compute, *inputs: torch.Tensor) -> None:
    """compute(*row slices) over every count and place gives the rows' bits of the whole."""
    whole = compute(*inputs)
    for count in COUNTS:
        for first in (0, 3, TOTAL - count):
            part = compute(*(x[first : first + count] for x in inputs))
            assert torch.equal(part, whole[first : first + count]), (count, first)


@pytest.mark.parametrize("width", [1, 4, 8, 24, 100])
@pytest.mark.parametrize(
    "fn",
    [torch.exp, torch.sigmoid, lambda z: torch.sqrt(F.softplus(z)), F.silu],
    ids=["exp", "sigmoid", "sqrt-softplus", "silu"],
)
def test_a_lanewise_pass_gives_an_element_the_same_bits_at_any_count(fn, width, threads):
    # Unwrapped, a row of 1 to 3 elements goes through ATen's scalar rest.
    values = torch.randn(TOTAL, width, generator=torch.Generator().manual_seed(width)) * 4
    assert_rows_alone(lambda x: lanewise(fn, x), values)
    torch.testing.assert_close(lanewise(fn, values), fn(values))


def test_a_lanewise_pass_over_more_than_one_call_keeps_its_bits():
    values = torch.randn(LANEWISE_MAX + 100, generator=torch.Generator().manual_seed(1))
    whole = lanewise(torch.sigmoid, values)
    torch.testing.assert_close(whole, torch.sigmoid(values))
    assert torch.equal(whole[-100:], lanewise(torch.sigmoid, values[-100:]))
    assert lanewise(torch.sigmoid, values[:0]).shape == (0,)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("features", [(64, 8), (256, 24), (37, 5)], ids=str)
def test_a_row_linear_row_has_the_same_bits_at_any_row_count_and_place(
    x_dtype, w_dtype, features, threads
):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(TOTAL, features[0], generator=generator).to(x_dtype)
    weight = torch.randn(features[1], features[0], generator=generator).to(w_dtype)
    assert_rows_alone(lambda rows: row_linear(rows, weight), x)
    out = row_linear(x, weight)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x.float() @ weight.float().T, rtol=1e-5, atol=1e-4)


def test_index_scores_rows_are_alone_and_sum_relu_scores_over_heads(threads):
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(TOTAL, 16, 32, generator=generator)
    weights = torch.randn(TOTAL, 16, generator=generator)
    keys = torch.randn(29, 32, generator=generator)

    def scores(q, w):
        return torch.ops.deepwell_invariant.index_scores(q, w, keys)

    assert_rows_alone(scores, queries, weights)
    expected = (torch.einsum("nhd,cd->nhc", queries, keys).relu() * weights[..., None]).sum(1)
    torch.testing.assert_close(scores(queries, weights), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sink_attention_rows_are_alone_and_match_the_tiled_softmax(dtype, threads):
    generator = torch.Generator().manual_seed(0)
    heads, dim, window, selected = 4, 32, 8, 4
    backend = BatchInvariantSinkAttention(heads, dim, window, selected)
    q = torch.randn(TOTAL, heads, dim, generator=generator).to(dtype)
    keys = torch.randn(TOTAL, window + selected, dim, generator=generator)
    valid = torch.rand(TOTAL, window + selected, generator=generator) < 0.7
    valid[0] = False  # a row that sees only the sink
    sinks = torch.randn(heads, generator=generator)

    def attend(q, keys, valid):
        return torch.ops.deepwell_invariant.sink_attention(q, keys, valid, sinks, backend.scale)

    assert_rows_alone(attend, q, keys, valid)
    out = attend(q, keys, valid)
    expected = backend._attend(q, keys, valid, sinks)
    assert out.dtype == dtype
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, expected, **tolerance)


def test_the_kernels_name_a_wrong_argument():
    with pytest.raises(RuntimeError, match="x \\[rows, 8\\] expected"):
        row_linear(torch.zeros(2, 4), torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="keys must be a contiguous float32"):
        torch.ops.deepwell_invariant.sink_attention(
            torch.zeros(1, 2, 4),
            torch.zeros(1, 3, 4, dtype=torch.float64),
            torch.ones(1, 3, dtype=torch.bool),
            torch.zeros(2),
            1.0,
        )
