"""V4.1's mixture of experts: sqrt-softplus router with a selection-only correction bias,
clamped-SwiGLU routed experts and one shared expert (spec/deepseek_v41.md §3.4)."""

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.layers.batch_invariant import lanewise, row_kernels, row_linear, tiled_rows
from deepwell.engine.layers.blockscaled import MxFp4Experts, mxfp4_experts
from deepwell.engine.layers.forced_routing import ForcedRouting
from deepwell.engine.parallel.expert import ExpertParallel

# A packed bank's tensors, in MxFp4Experts' field order.
PACKED_COLUMNS = ("w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale")


class ClampedSwiGLU(nn.Module):
    """W2(silu(min(W1 x, limit)) · clamp(W3 x, ±limit)), the gate and up halves fused."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, limit: float, invariant: bool = False
    ) -> None:
        """`invariant`: the activation runs in whole vector bodies (batch_invariant.lanewise)."""
        super().__init__()
        self.limit = limit
        self.invariant = invariant
        self.w13 = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w13(x).float().chunk(2, dim=-1)
        inner = (
            lanewise(self._activation, gate, up) if self.invariant else self._activation(gate, up)
        )
        if weight is not None:
            inner = inner * weight.unsqueeze(-1)
        return self.w2(inner.to(x.dtype))

    def _activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)


class MoE(nn.Module):
    # The packed experts' product; the kernel set swaps in its own (kernel_set.py).
    packed_product = staticmethod(mxfp4_experts)

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
        parallel: ExpertParallel | None = None,
    ) -> None:
        """`parallel`: this rank's share of the routed experts (its placement's slots) and
        their token exchange; None holds every expert here."""
        super().__init__()
        # Batch-invariant: the router and each expert run row by row on the CPU (or on fixed
        # row tiles), as an expert sees however many rows of the step chose it
        # (layers/batch_invariant.py).
        self.invariant = invariant
        self.top_k = top_k
        self.routed_scaling = routed_scaling
        self.normalize = normalize
        self.gate = nn.Parameter(torch.zeros(num_experts, hidden_size))
        # Selects experts only; the routing weights come from the raw scores (noaux_tc).
        self.gate_bias = nn.Parameter(torch.zeros(num_experts))
        # The same for the positions of an image span, delimiters included (spec §3.8).
        self.gate_bias_vl = nn.Parameter(torch.zeros(num_experts))
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.limit = limit
        self.parallel = parallel
        self.num_slots = num_experts if parallel is None else parallel.placement.slots_per_rank
        # One module per slot (expanded weights), or, once bound packed, one MXFP4 bank
        # that runs all of a step's pairs in a single call.
        self.experts: nn.ModuleList | None = nn.ModuleList(
            ClampedSwiGLU(hidden_size, intermediate_size, limit, invariant)
            for _ in range(self.num_slots)
        )
        self.packed_experts: MxFp4Experts | None = None
        # The dtype its input comes in (the model's compute dtype), set as weights are bound:
        # an idle expert-parallel rank joins the exchange with zero rows of it.
        self.input_dtype = torch.float32
        self.shared_expert = ClampedSwiGLU(hidden_size, intermediate_size, limit, invariant)
        # A test override of the experts the router picks (DEEPWELL_FORCE_*), set by the model.
        self.forced_routing: ForcedRouting | None = None

    def forward(
        self,
        x: torch.Tensor,
        real_rows: int | None = None,
        image_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [rows, hidden] in the compute dtype → [rows, hidden] float32. Rows from
        `real_rows` on are padding (batch-invariant row tiles): with expert parallelism
        they are not sent to experts, whose output there nobody reads. `image_rows` [rows]
        bool: the rows of image spans, which select experts with `gate_bias_vl`."""
        scores = self._invariant_scores(x) if self.invariant else self._scores(x)
        bias = self.gate_bias
        if image_rows is not None:
            bias = torch.where(image_rows.unsqueeze(1), self.gate_bias_vl, self.gate_bias)
        if self.forced_routing is None:
            chosen = (scores + bias).topk(self.top_k, dim=-1).indices
        else:
            chosen = self.forced_routing.choose(
                x.shape[0], self.num_experts, self.top_k, scores.device
            )
        weights = scores.gather(1, chosen)
        if self.normalize and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling
        out = self.shared_expert(x).float()
        # Padding rows are not routed under expert parallelism (nobody reads them); on one
        # rank they are, as the tiles they sit in are computed whole anyway.
        real = x.shape[0] if self.parallel is None or real_rows is None else real_rows
        flat_experts = chosen[:real].flatten()
        order = flat_experts.argsort(stable=True)
        rows = order // self.top_k
        experts = flat_experts[order]
        flat_weights = weights[:real].flatten()[order]
        if self.parallel is None:
            routed = self._run_slots(x[rows], experts, flat_weights)
        else:
            routed = self.parallel.exchange(x, experts, rows, flat_weights, self._run_slots)
        # Pairs are sorted by expert and index_add_ adds them in order: summed expert by
        # expert in ascending order, so a row's sum has the same bits on any rank count
        # (with batch-invariant tiles an expert's row does not depend on the rows beside it).
        out.index_add_(0, rows, routed.float())
        return out

    def hold_packed_experts(self, bank: MxFp4Experts) -> None:
        """Run the routed experts from `bank` (one per slot) in place of the modules."""
        if bank.num_experts != self.num_slots:
            raise ValueError(f"a bank of {bank.num_experts} experts for {self.num_slots} slots")
        self.packed_experts = bank
        self.experts = None
        # Registered too, so the model's bytes count them (build.py sizes the KV cache) and
        # `.to(device)` moves them.
        columns = (bank.w1, bank.w1_scale, bank.w3, bank.w3_scale, bank.w2, bank.w2_scale)
        for column, tensors in zip(PACKED_COLUMNS, columns, strict=True):
            for slot, tensor in enumerate(tensors):
                self.register_buffer(f"packed_{column}_{slot}", tensor, persistent=False)

    def _apply(self, fn, recurse=True):
        """Module.to and friends; a bank whose buffers moved to another device is rebuilt
        there, with its address tables (their pointers are the old device's otherwise)."""
        super()._apply(fn, recurse)
        bank = self.packed_experts
        if bank is not None and self.packed_w1_0.device != bank.w1[0].device:
            self.packed_experts = MxFp4Experts.from_tensors(
                **{
                    column: [
                        getattr(self, f"packed_{column}_{slot}") for slot in range(len(bank.w1))
                    ]
                    for column in PACKED_COLUMNS
                }
            )
        return self

    def _run_slots(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The experts in this module's `slots` over the rows sent to them (one expert per
        row, weight applied; from any rank under expert parallelism), in the rows' order."""
        if self.packed_experts is not None:
            # Rows independent of each other: batch-invariant as it is.
            return self.packed_product(x, slots, weights, self.packed_experts, self.limit).to(
                x.dtype
            )
        out = x.new_empty(x.shape)
        order = slots.argsort(stable=True)
        start = 0
        for slot, count in enumerate(torch.bincount(slots, minlength=len(self.experts)).tolist()):
            if not count:
                continue
            picked = order[start : start + count]
            expert_rows = (x[picked], weights[picked])
            if self.invariant and not row_kernels(x):
                out[picked] = tiled_rows(self.experts[slot], *expert_rows)
            else:
                out[picked] = self.experts[slot](*expert_rows)
            start += count
        return out

    def _scores(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(F.softplus(x.float() @ self.gate.float().t()))

    def _invariant_scores(self, x: torch.Tensor) -> torch.Tensor:
        if row_kernels(x):
            logits = row_linear(x, self.gate.float())
            return lanewise(lambda z: torch.sqrt(F.softplus(z)), logits)
        return tiled_rows(self._scores, x)


def moe_graph_blocker(modules: Iterable[nn.Module]) -> str | None:
    """Why a CUDA graph cannot capture these layers' experts, or None: expanded experts are
    dispatched by counts read on the host, and the packed experts' torch product (the
    default off the CPU, where the native kernel does not run) loops over them on the host;
    the Triton kernel set's product does neither."""
    for module in modules:
        if not isinstance(module, MoE):
            continue
        if module.packed_experts is None:
            return "expanded experts are dispatched by counts read on the host"
        if module.packed_product is mxfp4_experts:
            return "the packed experts' torch product reads slots on the host (--kernels triton)"
    return None
