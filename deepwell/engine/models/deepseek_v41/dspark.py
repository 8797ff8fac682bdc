"""DSpark, DeepSeek-V4.1's draft head (`mtp.0..2`, spec/deepseek_v41.md §3.6): the context
rows it reads, filled while the target runs, and the draft block it computes from them.

The target hands over the mean over the 4 mHC streams of the residual entering attention of
the `dspark_target_layer_ids` layers; `main_norm(main_proj(·))` of those is projected per
stage into that stage's context ring (window keys at θ 10⁴, as the stage's window KV). A draft
runs the block [x_a, NOISE, ...] at positions a.. through the three stages (window attention
over the ring's [a − window, a) plus the whole block, bidirectional, with a sink; MoE; mHC),
and the last stage's collapsed streams give the base logits; the Markov and confidence heads
then run per position with the token drafted before (speculative/dspark.py).
"""

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.layers.batch_invariant import ROW_TILE
from deepwell.engine.layers.sink_attention import SinkAttentionBackend
from deepwell.engine.layers.step_metadata import SequenceSpan, StepMetadata, WindowPlan
from deepwell.engine.models.deepseek_v41.attention import Norm
from deepwell.engine.models.deepseek_v41.block import DeepseekV41Block
from deepwell.engine.models.deepseek_v41.config import DeepseekV41Config, LayerPlan, Selection
from deepwell.engine.models.deepseek_v41.mhc import collapse
from deepwell.engine.models.deepseek_v41.packed_modules import input_dtype
from deepwell.engine.models.deepseek_v41.rotary import PairRotary

# The ring spec of the stages' context rows (one layer per stage).
DSPARK_RING = "dspark_context"


class MarkovHead(nn.Module):
    """Rank-factorised first-order transition bias: head(embed(previous token))."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """Acceptance logit of a drafted position from [h | Markov embedding], in float32."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1, bias=False)


class DSparkStage(DeepseekV41Block):
    """A backbone-style block with window-only attention and its own MoE size; the first
    stage also projects the target features, the last carries the heads."""

    def __init__(
        self,
        config: DeepseekV41Config,
        stage: int,
        rotary: PairRotary,
        backend: SinkAttentionBackend,
        invariant: bool,
    ) -> None:
        c = config
        # Window-only attention (compress_ratios' draft entries are 0, spec §3.1).
        plan = LayerPlan(c.num_hidden_layers + stage, 0, Selection.NONE, -1, False, False, -1)
        experts = (c.dspark_n_routed_experts, c.dspark_num_experts_per_tok)
        super().__init__(c, plan, rotary, backend, invariant, experts)
        if stage == 0:
            targets = len(c.dspark_target_layer_ids)
            self.main_proj = nn.Linear(targets * c.hidden_size, c.hidden_size, bias=False)
            self.main_norm = Norm(c.hidden_size, c.rms_norm_eps)
        if stage == c.num_nextn_predict_layers - 1:
            self.norm = Norm(c.hidden_size, c.rms_norm_eps)
            self.markov_head = MarkovHead(c.vocab_size, c.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(c.hidden_size, c.dspark_markov_rank)

    def forward(self, streams, pre, rotation, meta, ring, dtype):
        windows = meta.windows[DSPARK_RING]
        return super().forward(
            streams, pre, rotation, meta, windows, ring, None, {}, None, dtype, None
        )

    def context_rows(self, main_x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """The stage's context KV of target positions, RoPE(kv_norm(wkv main_x)), before
        its fp8 rounding (the ring stores it encoded)."""
        attn = self.attn
        return attn.rotary.apply(attn.kv_norm(attn.wkv(main_x)), rotation)


class DSpark(nn.Module):
    """The draft stages; the embedding and head are the target's, passed in per call."""

    def __init__(
        self,
        config: DeepseekV41Config,
        rotary: PairRotary,
        backend: SinkAttentionBackend,
        invariant: bool,
    ) -> None:
        super().__init__()
        self.config = config
        # Batch-invariant: blocks padded to whole row tiles, as the target's steps.
        self.invariant = invariant
        self.rotary = rotary
        self.block_size = config.dspark_block_size
        self.window = config.sliding_window
        self.targets = config.dspark_target_layer_ids
        self.stages = nn.ModuleList(
            DSparkStage(config, stage, rotary, backend, invariant)
            for stage in range(config.num_nextn_predict_layers)
        )

    @property
    def last(self) -> DSparkStage:
        return self.stages[-1]

    def write_context(
        self,
        features: list[torch.Tensor],
        positions: torch.Tensor,
        meta: StepMetadata,
        rings: list[torch.Tensor],
    ) -> None:
        """Project a target step's features [rows, hidden] (one per target layer) into each
        stage's ring, as the target writes its own window rows (WindowPlan.write_rows)."""
        first = self.stages[0]
        main_x = first.main_norm(
            first.main_proj(torch.cat(features, dim=-1).to(input_dtype(first.main_proj)))
        )
        rotation = self.rotary.rotation(positions)
        fixed = meta.fixed
        plans = meta.windows[DSPARK_RING] if fixed is None else []
        for stage, ring in zip(self.stages, rings, strict=True):
            rows = stage.attn.storage.window.encode(
                stage.context_rows(main_x, rotation), ring.dtype
            )
            if fixed is not None:
                # A decode-graph step: a row per sequence, written where its plan says.
                ring[fixed.slots, fixed.windows[DSPARK_RING].write_rows] = rows
            for seq, plan in zip(meta.sequences, plans, strict=True):
                ring[seq.slot, plan.write_rows] = rows[seq.rows][plan.write_from :]

    def block(
        self,
        embed: nn.Embedding,
        anchors: torch.Tensor,
        positions: torch.Tensor,
        slots: list[int],
        rings: list[torch.Tensor],
        ring_rows: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft blocks of n sequences: anchor tokens [n] at positions [n] (on the host),
        their state slots. Returns the last stage's final-normed and pre-norm collapsed hidden states,
        each [n, block_size, hidden] (row k predicts the token at position a + k + 1)."""
        c = self.config
        width = self.block_size
        device = embed.weight.device
        anchor_positions = positions.tolist()
        anchors, positions = anchors.to(device), positions.to(device)
        ids = torch.full(
            (len(slots), width), c.dspark_noise_token_id, dtype=torch.long, device=device
        )
        ids[:, 0] = anchors
        block_positions = (positions.unsqueeze(1) + torch.arange(width, device=device)).flatten()
        meta = StepMetadata([])
        plans = []
        for index, (slot, anchor) in enumerate(zip(slots, anchor_positions, strict=True)):
            meta.sequences.append(
                SequenceSpan(index * width, width, anchor, slot, ids.new_empty(0))
            )
            # Context [a − window, a): rows the target wrote; the block sees all of its rows.
            context = torch.arange(max(0, anchor - self.window), anchor, device=device)
            plans.append(
                WindowPlan(
                    ring_rows=context % ring_rows,
                    visible=torch.ones(
                        width, len(context) + width, dtype=torch.bool, device=device
                    ),
                    write_rows=ids.new_empty(0),
                    write_from=width,
                )
            )
        meta.windows[DSPARK_RING] = plans
        ids = ids.flatten()
        num_rows = ids.shape[0]
        if self.invariant:
            padding = -num_rows % ROW_TILE
            ids = F.pad(ids, (0, padding))
            block_positions = F.pad(block_positions, (0, padding))
        rotation = self.rotary.rotation(block_positions)
        streams = embed(ids).float().unsqueeze(1).expand(-1, c.hc_mult, -1)
        pre = torch.zeros(streams.shape[0], c.hc_mult, device=device)
        pre[:, 0] = 1
        for stage, ring in zip(self.stages, rings, strict=True):
            streams, pre = stage(streams, pre, rotation, meta, ring, dtype)
        hidden = collapse(streams, pre)[:num_rows]
        normed = self.last.norm(hidden)
        return normed.unflatten(0, (len(slots), width)), hidden.unflatten(0, (len(slots), width))

    def markov(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Transition logits [n, vocab] (float32) and Markov embeddings [n, rank] of the
        previous tokens [n]."""
        head = self.last.markov_head
        embedding = head.embed(previous)
        return head.head(embedding).float(), embedding

    def confidence(self, hidden: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """Acceptance logits [n] from pre-norm hidden states [n, hidden] and Markov
        embeddings [n, rank] (the release's input; nemo feeds the normed state, spec §1.5)."""
        proj = self.last.confidence_head.proj
        return (
            torch.cat((hidden.float(), embedding.float()), dim=-1) @ proj.weight.float().t()
        ).squeeze(-1)
