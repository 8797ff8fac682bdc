"""Single-pass manifold hyper-connections (mHC): V4.1's 4-stream residual.

Each sublayer predicts (pre, post, comb) from the streams; its input is the streams
collapsed with the PREVIOUS sublayer's pre (spec/deepseek_v41.md §3.2).

Each runs per row in C++ (layers/hyper_connection.cpp) where that builds, else as the torch
ops below (the reference the kernel is checked against); both are batch invariant.
"""

import functools
import logging

import torch
from torch import nn

from deepwell.engine.layers.batch_invariant import row_kernels, row_linear, tiled_rows
from deepwell.engine.layers.decode_kernel import load_hyper_connection_kernel

logger = logging.getLogger(__name__)


@functools.cache
def native_ops() -> bool:
    """Whether torch.ops.deepwell_mhc is registered (the kernel built); logs once if not."""
    loaded = load_hyper_connection_kernel()
    if loaded.module is None:
        logger.warning("mHC runs as torch ops (slower): %s", loaded.reason)
    return loaded.module is not None


def _native(tensor: torch.Tensor) -> bool:
    """The C++ ops read host memory: tensors on another device take the torch ops."""
    return tensor.is_cpu and native_ops()


# The compute dtypes the native collapse gives.
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class HyperConnection(nn.Module):
    def __init__(
        self, streams: int, hidden_size: int, iterations: int, eps: float, norm_eps, invariant
    ):
        super().__init__()
        # Batch-invariant: the mixing product runs row by row (or on fixed row tiles).
        self.invariant = invariant
        self.streams = streams
        self.iterations = iterations
        self.eps = eps
        self.norm_eps = norm_eps
        width = streams * (streams + 2)
        self.fn = nn.Parameter(torch.zeros(width, streams * hidden_size))
        self.base = nn.Parameter(torch.zeros(width))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor):
        """streams [rows, S, hidden] float32 → pre [rows, S], post [rows, S], comb
        [rows, S_in, S_out], all float32."""
        flat = streams.flatten(1)
        mixes = self._invariant_mix(flat) if self.invariant else self._mix(flat)
        if _native(flat):
            return torch.ops.deepwell_mhc.coefficients(
                mixes.contiguous(),
                flat.contiguous(),
                self.base,
                self.scale,
                self.iterations,
                self.eps,
                self.norm_eps,
            )
        return self.coefficients(mixes, flat)

    def coefficients(self, mixes: torch.Tensor, flat: torch.Tensor):
        """(pre, post, comb) from the mixes [rows, S(S+2)] of the flattened streams, in torch."""
        s = self.streams
        mixes = mixes * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        scales = torch.cat(
            (self.scale[0].expand(s), self.scale[1].expand(s), self.scale[2].expand(s * s))
        )
        logits = torch.addcmul(self.base, mixes, scales)
        pre = torch.sigmoid(logits[:, :s]) + self.eps
        post = 2 * torch.sigmoid(logits[:, s : 2 * s])
        comb = logits[:, 2 * s :].unflatten(-1, (s, s)).softmax(dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iterations - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return pre, post, comb

    def _mix(self, flat: torch.Tensor) -> torch.Tensor:
        return flat @ self.fn.t()

    def _invariant_mix(self, flat: torch.Tensor) -> torch.Tensor:
        if row_kernels(flat):
            return row_linear(flat, self.fn)
        return tiled_rows(self._mix, flat)


def collapse(
    streams: torch.Tensor, pre: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Σ_s pre[s]·streams[s]: [rows, S, hidden] → [rows, hidden], summed in float32 and
    given in `dtype` (float32 or bfloat16)."""
    if _native(streams) and dtype in _NATIVE_DTYPES:
        return torch.ops.deepwell_mhc.collapse(streams.contiguous(), pre.contiguous(), dtype)
    return collapse_torch(streams, pre, dtype)


def collapse_norm(
    streams: torch.Tensor, pre: torch.Tensor, norm: nn.Module, dtype: torch.dtype
) -> torch.Tensor:
    """A sublayer's input: `norm` (attention.Norm: RMSNorm with a float32 weight) of the
    streams collapsed with `pre` and rounded to the compute dtype `dtype`."""
    if _native(streams) and dtype in _NATIVE_DTYPES and norm.weight.dtype == torch.float32:
        return torch.ops.deepwell_mhc.collapse_norm(
            streams.contiguous(), pre.contiguous(), norm.weight, norm.eps, dtype
        )
    return norm(collapse_torch(streams, pre, dtype))


def expand(output: torch.Tensor, streams: torch.Tensor, post, comb) -> torch.Tensor:
    """New stream s = post[s]·output + Σ_r comb[r, s]·streams[r]; output [rows, hidden]
    float32, the rest float32."""
    if _native(streams):
        return torch.ops.deepwell_mhc.expand(
            output.contiguous(), streams.contiguous(), post.contiguous(), comb.contiguous()
        )
    return expand_torch(output, streams, post, comb)


def collapse_torch(streams: torch.Tensor, pre: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`collapse` as torch ops."""
    return (pre.unsqueeze(-1) * streams).sum(1).to(dtype)


def expand_torch(output: torch.Tensor, streams: torch.Tensor, post, comb) -> torch.Tensor:
    """`expand` as torch ops."""
    mixed = (comb.unsqueeze(-1) * streams.unsqueeze(2)).sum(1)
    return post.unsqueeze(-1) * output.unsqueeze(1) + mixed
