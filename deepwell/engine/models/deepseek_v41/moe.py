"""V4.1's mixture of experts: sqrt-softplus router with a selection-only correction bias,
clamped-SwiGLU routed experts and one shared expert (spec/deepseek_v41.md §3.4)."""

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.layers.batch_invariant import tiled_rows


class ClampedSwiGLU(nn.Module):
    """W2(silu(min(W1 x, limit)) · clamp(W3 x, ±limit)), the gate and up halves fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.w13 = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w13(x).float().chunk(2, dim=-1)
        inner = F.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)
        if weight is not None:
            inner = inner * weight.unsqueeze(-1)
        return self.w2(inner.to(x.dtype))


class MoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        routed_scaling: float,
        normalize: bool,
        limit: float,
        invariant: bool,
    ) -> None:
        super().__init__()
        # Batch-invariant: the router and each expert run on fixed row tiles, as an expert
        # sees however many rows of the step chose it (layers/batch_invariant.py).
        self.invariant = invariant
        self.top_k = top_k
        self.routed_scaling = routed_scaling
        self.normalize = normalize
        self.gate = nn.Parameter(torch.zeros(num_experts, hidden_size))
        # Selects experts only; the routing weights come from the raw scores (noaux_tc).
        self.gate_bias = nn.Parameter(torch.zeros(num_experts))
        self.experts = nn.ModuleList(
            ClampedSwiGLU(hidden_size, intermediate_size, limit) for _ in range(num_experts)
        )
        self.shared_expert = ClampedSwiGLU(hidden_size, intermediate_size, limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, hidden] in the compute dtype → [rows, hidden] float32."""
        scores = tiled_rows(self._scores, x) if self.invariant else self._scores(x)
        chosen = (scores + self.gate_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.normalize and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling
        out = self.shared_expert(x).float()
        # Rows grouped by expert: one matmul per expert that any row chose.
        flat_experts = chosen.flatten()
        order = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=len(self.experts)).tolist()
        rows = order // self.top_k
        flat_weights = weights.flatten()[order]
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            picked = rows[start : start + count]
            expert_rows = (x[picked], flat_weights[start : start + count])
            if self.invariant:
                routed = tiled_rows(self.experts[expert], *expert_rows)
            else:
                routed = self.experts[expert](*expert_rows)
            out.index_add_(0, picked, routed.float())
            start += count
        return out

    def _scores(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(F.softplus(x.float() @ self.gate.float().t()))
