"""mHC's native ops (layers/hyper_connection.cpp) against the torch ops they replace
(mhc.py's `coefficients`, `collapse_torch`, `expand_torch`): the Sinkhorn-normalised
coefficients, collapse to float32 and bf16, expand; row counts across the parallel grain;
a row's result independent of its neighbours; bad shapes refused by name."""

import pytest
import torch

from deepwell.engine.models.deepseek_v41.attention import Norm
from deepwell.engine.models.deepseek_v41.mhc import (
    HyperConnection,
    collapse,
    collapse_norm,
    collapse_torch,
    expand,
    expand_torch,
    native_ops,
)

STREAMS, HIDDEN, ITERATIONS = 4, 96, 20


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not native_ops():
        pytest.skip("the mHC kernel cannot build here (no compiler)")


def hyper_connection(seed: int) -> HyperConnection:
    gen = torch.Generator().manual_seed(seed)
    hc = HyperConnection(STREAMS, HIDDEN, ITERATIONS, 1e-6, 1e-20, invariant=False)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=gen) * 0.05)
        hc.base.copy_(torch.randn(hc.base.shape, generator=gen))
        hc.scale.copy_(torch.rand(3, generator=gen) + 0.5)
    return hc


def streams_of(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, STREAMS, HIDDEN, generator=gen) * 2


@pytest.mark.parametrize("rows", [1, 5, 400])
@torch.no_grad()
def test_coefficients_match_the_torch_ops(rows):
    hc = hyper_connection(rows)
    streams = streams_of(rows, rows + 1)
    flat = streams.flatten(1)
    got = hc(streams)
    want = hc.coefficients(flat @ hc.fn.t(), flat)
    for name, g, w in zip(("pre", "post", "comb"), got, want, strict=True):
        assert g.shape == w.shape, name
        # float32 rounding only: the mean square's order of sum, exp's last bits, carried
        # through 20 Sinkhorn iterations.
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)
    # Sinkhorn's result: columns then rows sum to one (up to eps).
    comb = got[2]
    torch.testing.assert_close(comb.sum(-2), torch.ones(rows, STREAMS), rtol=0, atol=1e-4)


@torch.no_grad()
def test_a_rows_coefficients_do_not_depend_on_its_neighbours():
    # From given mixes: the mixing product is batch invariant only on row tiles
    # (HyperConnection's invariant mode), which is not the kernel's business.
    hc = hyper_connection(7)
    flat = streams_of(33, 8).flatten(1)
    mixes = flat @ hc.fn.t()

    def coefficients(rows: slice):
        return torch.ops.deepwell_mhc.coefficients(
            mixes[rows].contiguous(),
            flat[rows].contiguous(),
            hc.base,
            hc.scale,
            ITERATIONS,
            1e-6,
            1e-20,
        )

    batched = coefficients(slice(None))
    alone = coefficients(slice(17, 18))
    for b, a in zip(batched, alone, strict=True):
        assert torch.equal(b[17:18], a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 300])
def test_collapse_matches_the_torch_ops(dtype, rows):
    streams = streams_of(rows, 3)
    pre = torch.rand(rows, STREAMS, generator=torch.Generator().manual_seed(4))
    got = collapse(streams, pre, dtype)
    want = collapse_torch(streams, pre, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(
        got.float(), want.float(), rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6
    )


def test_collapse_takes_non_contiguous_streams():
    # The embedding's streams are one row expanded over the streams (a stride-0 view).
    row = torch.randn(3, 1, HIDDEN)
    streams = row.expand(-1, STREAMS, -1)
    pre = torch.rand(3, STREAMS)
    torch.testing.assert_close(
        collapse(streams, pre), collapse_torch(streams, pre, torch.float32), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 300])
@torch.no_grad()
def test_collapse_norm_matches_the_norm_of_the_rounded_collapse(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    streams = streams_of(rows, 6)
    pre = torch.rand(rows, STREAMS, generator=gen)
    norm = Norm(HIDDEN, 1e-20)
    norm.weight.copy_(1 + 0.1 * torch.randn(HIDDEN, generator=gen))
    got = collapse_norm(streams, pre, norm, dtype)
    want = norm(collapse_torch(streams, pre, dtype))
    assert got.dtype == dtype
    # bf16: a collapse summed in another order can round to the neighbouring bf16 value.
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=1e-5)
    assert torch.equal(collapse_norm(streams[-1:], pre[-1:], norm, dtype), got[-1:])


@pytest.mark.parametrize("rows", [1, 300])
def test_expand_matches_the_torch_ops(rows):
    gen = torch.Generator().manual_seed(rows)
    streams = streams_of(rows, 5)
    output = torch.randn(rows, HIDDEN, generator=gen)
    post = torch.rand(rows, STREAMS, generator=gen) * 2
    comb = torch.rand(rows, STREAMS, STREAMS, generator=gen)
    got = expand(output, streams, post, comb)
    want = expand_torch(output, streams, post, comb)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(expand(output[:1], streams[:1], post[:1], comb[:1]), got[:1])


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(RuntimeError, match="pre must be"):
        torch.ops.deepwell_mhc.collapse(streams_of(2, 0), torch.rand(2, 3), torch.float32)
    with pytest.raises(RuntimeError, match="mixes"):
        torch.ops.deepwell_mhc.coefficients(
            torch.rand(2, 7), torch.rand(2, 8), torch.rand(7), torch.rand(3), 3, 1e-6, 1e-6
        )
