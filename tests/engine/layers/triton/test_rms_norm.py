"""The Triton residual add + RMSNorm against TorchGlue, under the interpreter."""

import pytest
import torch

from deepwell.engine.layers.fused_glue import TorchGlue
from deepwell.engine.layers.triton.rms_norm import add_rms_norm


@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("hidden", [64, 96])  # a power of two, and one the block masks
def test_add_rms_norm_equals_the_torch_glue(with_delta, hidden):
    torch.manual_seed(0)
    residual = torch.randn(5, hidden)
    delta = torch.randn(5, hidden) if with_delta else None
    weight = torch.randn(hidden)
    expected_stream, expected = TorchGlue.add_rms_norm(residual, delta, weight, 1e-5, torch.float32)
    stream, out = add_rms_norm(residual.clone(), delta, weight, 1e-5, torch.float32)
    torch.testing.assert_close(stream, expected_stream, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_the_normed_rows_come_in_the_compute_dtype():
    residual, weight = torch.randn(3, 32), torch.ones(32)
    _, out = add_rms_norm(residual.clone(), None, weight, 1e-6, torch.bfloat16)
    expected = TorchGlue.add_rms_norm(residual, None, weight, 1e-6, torch.bfloat16)[1]
    assert out.dtype is torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
