"""Modules over weights kept in their released encodings (spec §3.8), bound in place of the
float nn.Linear / nn.Embedding a freshly built model has (binding.py).

Each takes and returns what the module it replaces does: a linear's input and output share
a dtype, an embedding returns the model's dtype. The products are layers/blockscaled.py's.
The stored tensors are (non-persistent) buffers: the model's bytes count them, and the KV
cache is sized beside them (build.py).
"""

from __future__ import annotations

import torch
from torch import nn

from deepwell.engine.layers.blockscaled import bf16_linear, check_fp8_weight, fp8_block_product
from deepwell.engine.models.deepseek_v41.weight_formats import SCALE_GROUP, dequantize_fp8_rows


class Fp8BlockLinear(nn.Module):
    """A bias-free linear over FP8 E4M3 weights with 32x32-block E8M0 scales. Several parts
    stack their outputs in order (a fused gate/up projection whose halves were released
    apart, their row counts not always whole scale blocks)."""

    # The product over the stored bytes (checked once, here); the kernel set swaps in its
    # own (kernel_set.py).
    product = staticmethod(fp8_block_product)

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        # The buffers' names, read straight from _buffers in forward: nn.Module's
        # __getattr__ and the names' formatting cost more than a small product at batch 1.
        self.part_names = [(f"weight{index}", f"scale{index}") for index in range(len(parts))]
        for (weight_name, scale_name), (weight, scale) in zip(self.part_names, parts, strict=True):
            check_fp8_weight(weight, scale)
            self.register_buffer(weight_name, weight, persistent=False)
            self.register_buffer(scale_name, scale, persistent=False)
        self.num_parts = len(parts)
        self._band_views: dict[int, list[tuple[torch.Tensor, torch.Tensor, int, int]]] = {}
        self.in_features = parts[0][0].shape[1]
        self.out_features = sum(weight.shape[0] for weight, _ in parts)

    @property
    def parts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        buffers = self._buffers
        return [(buffers[weight], buffers[scale]) for weight, scale in self.part_names]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step's inputs are [rows, in] already: no reshape either way then.
        flat = x.dim() == 2
        rows = (x if flat else x.reshape(-1, self.in_features)).contiguous()
        if self.num_parts == 1:
            ((weight, scale),) = self.parts
            out = self.product(rows, weight, scale)
        else:
            out = torch.cat([self.product(rows, weight, scale) for weight, scale in self.parts], 1)
        out = out.to(x.dtype)
        return out if flat else out.reshape(*x.shape[:-1], self.out_features)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, groups, in] → [rows, groups, out / groups]: group g through its own
        band of output rows (attention's grouped output projection)."""
        outputs = []
        for group, (weight, scale, offset, band) in enumerate(self._bands(x.shape[1])):
            product = self.product(x[:, group].contiguous(), weight, scale)
            outputs.append(
                product
                if offset == 0 and product.shape[1] == band
                else product[:, offset : offset + band]
            )
        return torch.stack(outputs, dim=1).to(x.dtype)

    def _bands(self, groups: int) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
        """Per group: the whole 32-row scale blocks its band touches (weight rows, scales),
        the band's first row within them and its row count. Views, made on the first call
        for a group count and again after the buffers move (`_apply`)."""
        bands = self._band_views.get(groups)
        if bands is None:
            ((weight, scale),) = self.parts
            band = self.out_features // groups
            bands = []
            for group in range(groups):
                first = group * band // SCALE_GROUP
                last = -(-(group + 1) * band // SCALE_GROUP)
                rows = slice(first * SCALE_GROUP, last * SCALE_GROUP)
                bands.append((weight[rows], scale[first:last], group * band - rows.start, band))
            self._band_views[groups] = bands
        return bands

    def _apply(self, fn, recurse=True):
        # The band views are of the old buffers; moved buffers get new ones.
        self._band_views.clear()
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks"


def grouped_projection(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [rows, groups, in] → [rows, groups, out / groups] through `linear`'s rows split into
    one band per group, plain or packed."""
    if isinstance(linear, Fp8BlockLinear):
        return linear.grouped(x)
    weight = linear.weight.view(x.shape[1], -1, x.shape[-1])
    return torch.einsum("ngi,goi->ngo", x, weight)


def input_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype a linear's input is given in: a plain one's weight dtype; a packed one
    takes any float input and answers in it, so float32."""
    return linear.weight.dtype if isinstance(linear, nn.Linear) else torch.float32


class Bf16Linear(nn.Module):
    """A bias-free linear over a bf16 weight (the head, the Markov heads), computed in
    float32 without a float32 copy of the weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = bf16_linear(x.reshape(-1, self.in_features).contiguous(), self.weight)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16"


class Fp8RowEmbedding(nn.Module):
    """A table of FP8 E4M3 rows with row-wise E8M0 scales (Engram): a lookup gathers and
    dequantises only the rows it reads."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize_fp8_rows(self.weight[flat], self.scale[flat])
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fp8 rows"
