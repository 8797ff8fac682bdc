"""float32 CPU linears: calls of 10-15 rows run as 16-row calls over zero rows, every other
call as it came; the engine turns its plain float32 linears so, and only outside the
batch-invariant mode."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.layers import float32_linear
from deepwell.engine.layers.float32_linear import (
    GEMM_ROWS,
    RowPaddedLinear,
    pad_small_calls,
)

needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="no MKL here")


def padded_linear(in_features: int, out_features: int, bias: bool) -> RowPaddedLinear:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    linear.__class__ = RowPaddedLinear
    return linear


@pytest.mark.parametrize("rows", [1, 9, 10, 13, 15, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_a_call_multiplies_as_many_rows_as_its_kernel_path_wants(monkeypatch, rows, bias):
    linear = padded_linear(24, 40, bias)
    x = torch.randn(rows, 24)
    seen = []
    linear_of = F.linear

    def spy(inputs, weight, b=None):
        seen.append(inputs.clone())
        return linear_of(inputs, weight, b)

    monkeypatch.setattr(float32_linear.F, "linear", spy)
    out = linear(x)
    monkeypatch.undo()
    (called,) = seen
    padded = 10 <= rows < 16
    assert called.shape[0] == (GEMM_ROWS if padded else rows)
    assert torch.equal(called[:rows], x) and not called[rows:].any()
    assert out.shape == (rows, 40)
    assert torch.equal(out, F.linear(called, linear.weight, linear.bias)[:rows])


def test_only_plain_float32_linears_of_two_mib_or_more_are_turned():
    # 512 x 1,024 float32 is 2 MiB; the others are smaller, or bf16, or not linears.
    model = nn.Sequential(
        nn.Linear(512, 1024),
        nn.Linear(512, 1023),
        nn.Linear(1024, 1024).bfloat16(),
        nn.Embedding(4, 8),
        nn.Sequential(nn.Linear(1024, 1024, bias=False)),
    )
    turned = pad_small_calls(model)
    kinds = [type(m) for m in model.modules() if isinstance(m, nn.Linear)]
    if not torch.backends.mkl.is_available():
        assert turned == 0
        return
    assert turned == 2
    assert kinds == [RowPaddedLinear, nn.Linear, nn.Linear, RowPaddedLinear]


@needs_mkl
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_the_float32_engine_pads_outside_the_batch_invariant_mode(
    monkeypatch, make_core, batch_invariant
):
    monkeypatch.setattr(float32_linear, "PADDED_WEIGHT_BYTES", 0)  # the tiny model's too
    core = make_core(batch_invariant=batch_invariant)
    linears = [m for m in core.runner.model.modules() if isinstance(m, nn.Linear)]
    padded = [type(m) is RowPaddedLinear for m in linears]
    assert linears and all(padded) != batch_invariant and any(padded) != batch_invariant
