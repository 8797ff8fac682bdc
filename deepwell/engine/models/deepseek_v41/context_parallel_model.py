"""DeepSeek-V4.1 on rank 0 under context parallelism: a step's long prefill chunks run
across the group (context_parallel.py), everything else on rank 0 alone.

It stands in for the model in the runner (the same call and `compute_logits`), so the
scheduler, the KV manager and the step pipeline stay as they are: the prefill's caches land
in rank 0's slot and blocks, and its last row's hidden state in the step's hidden states.
`V41ContextParallel` is the model's context-parallel hook (contract.py), which the generic
launcher (parallel/context.py) calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from deepwell.engine.kv.cache import KVCache
from deepwell.engine.layers.step_metadata import StepMetadata
from deepwell.engine.models.deepseek_v41.context_parallel import (
    ContextParallelPrefill,
    SequenceCaches,
)
from deepwell.engine.parallel.context_group import ContextGroup

if TYPE_CHECKING:
    from deepwell.engine.models.deepseek_v41.model import DeepseekV41ForCausalLM


class V41ContextParallel:
    """The model's context-parallel forward: rank 0's stand-in, and the followers' prefill."""

    def __init__(self, model: DeepseekV41ForCausalLM) -> None:
        self.model = model

    def leader(self, group: ContextGroup, min_tokens: int | None) -> ContextParallelModel:
        # The default: twice the sliding window (settings/engine.py).
        return ContextParallelModel(
            self.model, group, min_tokens or 2 * self.model.config.sliding_window
        )

    def follower(self, group: ContextGroup) -> Callable[[torch.Tensor, int], object]:
        prefill = ContextParallelPrefill(self.model, group)
        return lambda token_ids, start: prefill.forward(token_ids, start, None)


class ContextParallelModel:
    def __init__(self, model: DeepseekV41ForCausalLM, group: ContextGroup, min_tokens: int) -> None:
        self.model = model
        self.group = group
        self.min_tokens = min_tokens
        self.prefill = ContextParallelPrefill(model, group)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: StepMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        long = [
            index for index, seq in enumerate(meta.sequences) if seq.num_rows >= self.min_tokens
        ]
        if not long:
            return self.model(input_ids, positions, meta, kv_cache)
        # Only the last row of a parallel prefill chunk is read (it samples when it ends
        # the prompt); the others stay 0.
        hidden = torch.zeros(input_ids.numel(), self.model.config.hidden_size)
        rest = [index for index in range(len(meta.sequences)) if index not in long]
        if rest:
            sub, rows = select_sequences(meta, rest)
            hidden[rows] = self.model(input_ids[rows], positions[rows], sub, kv_cache)
        depth = self.prefill.history
        for index in long:
            seq = meta.sequences[index]
            token_ids = input_ids[seq.rows]
            if depth:
                # The tokens before the chunk its Engram hashes read, oldest first.
                earlier = meta.token_history[seq.row].flip(0)
                token_ids = torch.cat((earlier, token_ids))
            caches = SequenceCaches(self.model, kv_cache, meta, index)
            try:
                self.group.announce(token_ids, seq.start)
                last = self.prefill.forward(token_ids, seq.start, caches)
            except BaseException as error:
                self.group.abandon(error)
                raise
            hidden[seq.row + seq.num_rows - 1] = last[0]
        return hidden

    def compute_logits(
        self, hidden: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model.compute_logits(hidden, rows)

    def close(self) -> None:
        self.group.close()


def select_sequences(meta: StepMetadata, indices: list[int]) -> tuple[StepMetadata, torch.Tensor]:
    """The step's metadata for some of its sequences, renumbered from row 0, and their rows
    in the step. Covers what a V4.1 step without bounded replay holds (EngineArgs refuses
    context parallelism with a truncation mode)."""
    sequences, rows = [], []
    for index in indices:
        seq = meta.sequences[index]
        sequences.append(dataclasses.replace(seq, row=len(rows)))
        rows += range(seq.row, seq.row + seq.num_rows)
    row_index = torch.tensor(rows, dtype=torch.long)

    def pick(plans: dict) -> dict:
        return {key: [per_sequence[i] for i in indices] for key, per_sequence in plans.items()}

    history = meta.token_history
    sub = StepMetadata(
        sequences,
        token_history=None if history is None else history[row_index],
        windows=pick(meta.windows),
        compressed=pick(meta.compressed),
        tails=pick(meta.tails),
    )
    return sub, row_index
