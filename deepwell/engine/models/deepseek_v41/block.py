"""One DeepSeek-V4.1 block (spec/deepseek_v41.md §3.2): Engram read, CSA2 attention and
MoE on the 4-stream mHC residual. The backbone's layers and DSpark's draft stages are both.
"""

from collections.abc import Callable

import torch
from torch import nn

from deepwell.engine.layers.sink_attention import SinkAttentionBackend
from deepwell.engine.models.deepseek_v41.attention import CSA2Attention, Norm
from deepwell.engine.models.deepseek_v41.config import DeepseekV41Config, LayerPlan
from deepwell.engine.models.deepseek_v41.engram import Engram
from deepwell.engine.models.deepseek_v41.mhc import HyperConnection, collapse_norm, expand
from deepwell.engine.models.deepseek_v41.moe import MoE
from deepwell.engine.models.deepseek_v41.rotary import PairRotary
from deepwell.engine.parallel.expert import ExpertParallel


class DeepseekV41Block(nn.Module):
    def __init__(
        self,
        config: DeepseekV41Config,
        plan: LayerPlan,
        rotary: PairRotary,
        backend: SinkAttentionBackend,
        invariant: bool,
        experts: tuple[int, int] | None = None,
        parallel: ExpertParallel | None = None,
    ) -> None:
        """`experts`: routed experts and experts per token, if not the backbone's;
        `parallel`: the routed experts are sharded over expert-parallel ranks."""
        super().__init__()
        self.plan = plan
        c = config
        routed, per_token = experts or (c.n_routed_experts, c.num_experts_per_tok)
        self.attn = CSA2Attention(c, plan, backend, rotary, invariant)
        self.ffn = MoE(
            c.hidden_size,
            c.moe_intermediate_size,
            routed,
            per_token,
            c.routed_scaling_factor,
            c.norm_topk_prob,
            c.swiglu_limit,
            invariant,
            parallel,
        )
        self.attn_norm = Norm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = Norm(c.hidden_size, c.rms_norm_eps)

        def hyper_connection() -> HyperConnection:
            return HyperConnection(
                c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, invariant
            )

        self.hc_attn = hyper_connection()
        self.hc_ffn = hyper_connection()
        self.engram = None
        if plan.engram_slot >= 0:
            self.engram = Engram(
                c.engram_num_embeddings[plan.engram_slot],
                c.engram_head_dim,
                (c.engram_max_ngram_size - 1) * c.engram_n_heads,
                c.hc_mult,
                c.hidden_size,
                c.rms_norm_eps,
                invariant,
            )

    def attention_input(self, streams, pre, engram_rows, dtype, image_rows=None) -> torch.Tensor:
        """The attention's input u alone (compact bounded replay compresses dropped rows)."""
        if self.engram is not None:
            streams = self.engram(streams, engram_rows, image_rows)
        return collapse_norm(streams, pre, self.attn_norm, dtype)

    def forward(
        self,
        streams,
        pre,
        rotation,
        meta,
        windows,
        ring,
        compressed,
        shared,
        engram_rows,
        dtype,
        features,
        real_rows=None,
        image_rows=None,
    ):
        def attend(u: torch.Tensor) -> torch.Tensor:
            return self.attn(u, rotation, meta, windows, ring, compressed, shared)

        return self.run(streams, pre, attend, engram_rows, dtype, features, real_rows, image_rows)

    def run(
        self,
        streams: torch.Tensor,
        pre: torch.Tensor,
        attend: Callable[[torch.Tensor], torch.Tensor],
        engram_rows: torch.Tensor | None,
        dtype: torch.dtype,
        features: list[torch.Tensor] | None,
        real_rows: int | None = None,
        image_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block around its attention `attend(u)`, the one part that reads other
        positions (context parallelism passes its own, context_parallel.py). `real_rows`:
        the rows before batch-invariant padding, the ones expert parallelism sends.
        `image_rows` [rows] bool: image-span rows, which Engram leaves as they are and
        which route with the image bias."""
        if self.engram is not None:
            streams = self.engram(streams, engram_rows, image_rows)
        if features is not None:
            # DSpark's target feature: the residual entering attention, streams averaged.
            features.append(streams.mean(1))
        attn_pre, post, comb = self.hc_attn(streams)
        u = collapse_norm(streams, pre, self.attn_norm, dtype)
        streams = expand(attend(u).float(), streams, post, comb)
        ffn_pre, post, comb = self.hc_ffn(streams)
        u = collapse_norm(streams, attn_pre, self.ffn_norm, dtype)
        streams = expand(self.ffn(u, real_rows, image_rows), streams, post, comb)
        return streams, ffn_pre
