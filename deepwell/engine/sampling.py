"""Sampler: grammar masks, penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs
and (DEEPWELL_COMPUTE_SUM_SMALLER_PROBS) each token's sum of smaller probabilities.

Draws are counter-based (spec/deepinfer.md §1.6): a row's uniform comes from its request's
seed and the sampled position alone, so a sample never depends on the rest of the batch.
"""

import functools
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from deepwell.engine.layers.decode_kernel import load_sampling_kernel
from deepwell.engine.outputs import TokenLogprobs
from deepwell.engine.request import Request
from deepwell.engine.structured import apply_masks

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
# SplitMix64's increment, 2**64 / golden ratio; DeepInfer also uses it to spread positions.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


@dataclass
class SampledTokens:
    """One token per row, with its logprobs where the row's request asked for them and,
    where the sampler was asked, the sum of the probabilities <= its own (per row)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    sum_smaller_probs: list[float] | None = None


class Sampler:
    def __call__(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [rows, vocab] float32, one row per request → token ids and logprobs."""
        sampled = self.sample(logits, requests)
        return sampled.token_ids, sampled.logprobs

    def sample(
        self, logits: torch.Tensor, requests: list[Request], sum_smaller: bool = False
    ) -> SampledTokens:
        """As calling the sampler; `sum_smaller` also gives each token's sum of smaller
        probabilities (DeepInfer's COMPUTE_SUM_SMALLER_PROBS) under the distribution it was
        chosen from (`token_distribution`)."""
        wants_logprobs = any(r.params.logprobs for r in requests)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
        # Only constrained rows pay for a mask; logprobs stay those of the raw model.
        constrained = [
            row for row, r in enumerate(requests) if r.matcher and r.matcher.constrains_next
        ]
        if constrained:
            masks = np.empty((len(constrained), (logits.shape[-1] + 31) // 32), dtype=np.uint32)
            for index, row in enumerate(constrained):
                requests[row].matcher.fill_mask(masks[index])
            apply_masks(logits, constrained, masks)
        if any(r.params.adjusts_logits for r in requests):
            logits = logits.clone()
            for row, request in enumerate(requests):
                if request.params.adjusts_logits:
                    adjust_logits(logits[row], request)
        sampled_rows = [row for row, r in enumerate(requests) if not r.params.greedy]
        if len(sampled_rows) < len(requests):
            tokens = first_argmax(logits)
        else:
            # Every row draws: no argmax to pay for (a pass over the logits).
            tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            # The token drawn now takes position num_tokens in its sequence.
            draws = [uniform(requests[i].seed, requests[i].num_tokens) for i in sampled_rows]
            drawn = logits if len(sampled_rows) == len(requests) else logits[rows]
            tokens[rows] = self.draw(drawn, [requests[i] for i in sampled_rows], draws)
        token_ids = tokens.tolist()
        for row, request in enumerate(requests):
            golden = request.params.golden_token_ids
            if golden and request.num_output_tokens < len(golden):
                # Teacher forcing (DeepInfer's golden_token_ids): the drawn token gives way.
                token_ids[row] = golden[request.num_output_tokens]
        logprobs = [
            token_logprobs(raw_logprobs[row], token_ids[row], r.params.top_logprobs)
            if raw_logprobs is not None and r.params.logprobs
            else None
            for row, r in enumerate(requests)
        ]
        sums = None
        if sum_smaller:
            sums = sum_smaller_probs(token_distribution(logits, requests), token_ids)
        return SampledTokens(token_ids, logprobs, sums)

    def draw(self, logits: torch.Tensor, requests: list[Request], uniforms: list[float]):
        """Tokens of the sampled rows: temperature, top-k / top-p / min-p, then each row's
        uniform through the inverse CDF (the Triton kernel set draws the same in one kernel).
        On the CPU, rows without top-k are drawn in one native pass a row with the same
        tokens (`native_top_p_draw`)."""
        vocab = logits.shape[-1]
        if _native_rows(logits) and not any(0 < r.params.top_k < vocab for r in requests):
            return native_top_p_draw(logits, requests, uniforms)
        return inverse_cdf(filtered_probs(logits, requests), uniforms)


def native_top_p_draw(
    logits: torch.Tensor, requests: list[Request], uniforms: list[float]
) -> torch.Tensor:
    """`inverse_cdf(filtered_probs(logits, requests), uniforms)` for rows without top-k, in
    one native pass a row (sampling_ops.cpp `top_p_sample`): the same float32 division,
    softmaxes, nucleus and floor, without their [rows, vocab] tensors: sampled W's sampler
    took 8.7 ms a step through the torch ops, 3.5 this way. A row holding a NaN, or with
    every token masked, takes the torch ops."""
    device = logits.device
    top_ps = [r.params.top_p for r in requests]
    tokens = torch.ops.deepwell_sampling.top_p_sample(
        logits,
        torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype),
        torch.tensor(top_ps, dtype=logits.dtype),
        torch.tensor(
            [p + _PREFIX_MASS_MARGIN if p < 1 else math.inf for p in top_ps], dtype=torch.float64
        ),
        torch.tensor([r.params.min_p for r in requests], dtype=logits.dtype),
        torch.tensor(uniforms, dtype=torch.float64),
    )
    stray = [row for row, token in enumerate(tokens.tolist()) if token < 0]
    if stray:
        rows = torch.tensor(stray, device=device)
        probs = filtered_probs(logits[rows], [requests[row] for row in stray])
        tokens[rows] = inverse_cdf(probs, [uniforms[row] for row in stray])
    return tokens


# first_argmax's block: rows of logits are scanned for their maximum a block at a time.
_ARGMAX_BLOCK = 1024
# Below this many rows one `max` beats the blocked search's dozen small ops: with the
# caches cold after the lm_head, as in a step, 75 against 169 µs for one row of SmolLM2's
# logits, about even at 8 rows.
_ARGMAX_BLOCKED_MIN_ROWS = 8


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the first of its tied maxima (argmax's answer).

    On the CPU one native scan a row (sampling_ops.cpp): for 64 rows of SmolLM2's 49,152
    float32 logits, one thread, 0.57 ms against the blocked search's 0.75. Elsewhere, by
    blocks: on CPU `max(dim)` with indices runs ~4x slower than `amax` (2.1 against 0.5 ms for
    64 rows of SmolLM2's 49,152 logits, one thread; argmax is slower still): so the row maxima
    are found per block with amax, the first block holding the row's maximum picked, and
    only a block-wide window there searched with indices. Earlier tied maxima would lie in
    an earlier block, or earlier in the same window, so the answer is the first of the tied
    maxima. Past the amax, a step's greedy rows pay five small ops on tensors of `rows`
    elements or one window each: after the forward has evicted their code and data, each
    op's first call in a step costs ~30 µs, so the ops are few and none builds a
    [rows, block] index.
    """
    if _native_rows(logits):
        return torch.ops.deepwell_sampling.first_argmax(logits)
    rows, vocab = logits.shape
    if rows < _ARGMAX_BLOCKED_MIN_ROWS:
        # max's indices are argmax's (the first of tied maxima), 3.5x faster on CPU.
        return logits.max(dim=-1).indices
    width = min(_ARGMAX_BLOCK, vocab)
    full = vocab // width * width
    maxima = logits[:, :full].view(rows, -1, width).amax(dim=-1)
    if full < vocab:
        maxima = torch.cat((maxima, logits[:, full:].amax(dim=-1, keepdim=True)), dim=1)
    starts = maxima.max(dim=-1).indices * width
    if full < vocab:
        # A short last block's window starts `width` before the end: the columns it takes
        # from the block before hold no tie, as that block's maximum is smaller or it
        # would have been picked.
        starts.clamp_(max=vocab - width)
    # unfold: every window of `width` columns as a view, one per start column.
    windows = logits.unfold(1, width, 1).gather(1, starts.view(rows, 1, 1).expand(-1, 1, width))
    return starts + windows.view(rows, width).max(dim=-1).indices


def splitmix64(x: int) -> int:
    """One SplitMix64 output for state `x` (the state advances by the golden gamma first)."""
    z = (x + _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int, case: int = 0) -> float:
    """The uniform in [0, 1) of a sequence's draw at `position` (spec/deepinfer.md §1.6).

    `case` is 1 for a draft (next-n) prediction, 0 for the main model's sample.
    """
    s = ((3 * position + case) * _GOLDEN_GAMMA) & _MASK64
    bits = splitmix64((seed + (s ^ ((s << 13) & _MASK64))) & _MASK64)
    return (bits >> 11) * 2.0**-53


def inverse_cdf(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """Per row, the first token whose float64 cumulative probability exceeds u * total.

    A zero-probability token never exceeds what the token before it already reached, so it
    is never chosen; when u * total rounds up to the total, the last token with mass is.
    On the CPU one native scan a row gives the same token as torch's float64 cumsum and
    search (the same sequential sum, its zeros skipped) without their whole-row passes.
    """
    targets = torch.tensor(uniforms, dtype=torch.float64, device=probs.device)
    if _native_rows(probs):
        return torch.ops.deepwell_sampling.inverse_cdf(probs, targets)
    cdf = probs.double().cumsum(dim=-1)
    targets = targets.unsqueeze(1) * cdf[:, -1:]
    index = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    vocab = probs.shape[-1]
    last_with_mass = vocab - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.where(index >= vocab, last_with_mass, index)


def adjust_logits(row: torch.Tensor, request: Request) -> None:
    """In place on one row of logits: penalties, logit bias, then the minimum length and
    DeepInfer's first tokens without EOS."""
    params = request.params
    if params.penalised:
        apply_penalties(row, request)
    if params.logit_bias:
        # Ids beyond the vocabulary were refused at intake.
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=row.device)
        bias = list(params.logit_bias.values())
        row[ids] += torch.tensor(bias, dtype=row.dtype, device=row.device)
    if request.num_output_tokens < params.min_tokens and request.stop_token_ids:
        # vLLM's min_tokens: no stop id (EOS included unless ignore_eos) before the minimum.
        stops = sorted(request.stop_token_ids)
        row[torch.tensor(stops, dtype=torch.long, device=row.device)] = float("-inf")
    if request.num_output_tokens < params.first_n_token_no_eos:
        # An eos_id beyond the vocabulary was refused at intake.
        row[params.eos_id] = float("-inf")


def apply_penalties(row: torch.Tensor, request: Request) -> None:
    """In place on one row of logits."""
    params = request.params
    if params.repetition_penalty != 1.0:
        # HF semantics: every token seen in prompt or output; shrink positive logits,
        # grow negative ones.
        seen = torch.tensor(sorted(set(request.token_ids)), dtype=torch.long, device=row.device)
        scores = row[seen]
        penalty = params.repetition_penalty
        row[seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
    if params.presence_penalty or params.frequency_penalty:
        # OpenAI semantics: output tokens only.
        output = torch.tensor(request.output_token_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(output, minlength=row.shape[0]).to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, as probabilities over the vocabulary."""
    device = logits.device
    temperatures = torch.tensor(
        [r.params.temperature for r in requests], dtype=logits.dtype, device=device
    )
    scaled = logits / temperatures.unsqueeze(1)
    top_ks = [r.params.top_k for r in requests]
    top_ps = [r.params.top_p for r in requests]
    min_ps = [r.params.min_p for r in requests]
    probs = nucleus_logits(scaled, top_ks, top_ps).softmax(dim=-1)
    if any(p > 0 for p in min_ps):
        floor = torch.tensor(min_ps, dtype=probs.dtype, device=device)[:, None]
        floor = floor * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


# A top-p row's ranked prefix runs on until it holds this much more mass than top_p: the
# float32 cumulative sums that decide the nucleus differ from the kernel's float64 ones by
# a few 1e-6 at most, so every token past the prefix has mass before it of at least top_p.
_PREFIX_MASS_MARGIN = 1e-4


def nucleus_logits(scaled: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Per row of temperature-scaled logits, -inf outside its top-k and then its top-p set
    (rows with neither stay as they are).

    Ranks are those of a stable descending sort, so among tied logits the lower id ranks
    first: top-k 1 and a tiny top-p keep greedy's token (the first of tied maxima), and bf16
    logits tie often. Only each row's ranked prefix that can hold the set is ordered
    (`ranked_prefix`): its top-k, or for top-p alone the tokens that reach top_p's mass.
    The decision is the full sort's, in its float32 arithmetic: within the top-k the same
    softmax of the same ranked logits, a token dropped when the mass before it reaches top_p
    (the first always stays). For top-p alone the mass is the vocabulary's softmax, whose
    float32 sum runs in vocabulary order where the full sort's ran in rank order: the two
    can keep different tokens only where the mass before one is within float32 rounding
    (a few 1e-6) of top_p (tests/engine/test_sampling_nucleus.py).
    """
    rows, vocab = scaled.shape
    device = scaled.device
    # A top_k past the vocabulary keeps all of it (and must not overflow a tensor).
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    filtered = [row for row in range(rows) if ks[row] < vocab or top_ps[row] < 1]
    if not filtered:
        return scaled
    logits = scaled if len(filtered) == rows else scaled[filtered]
    k = torch.tensor([ks[row] for row in filtered], device=device)
    # Top-p alone: the nucleus of the whole vocabulary's distribution, found by its mass.
    by_mass = [ks[row] == vocab for row in filtered]
    probs = logits.softmax(dim=-1) if any(by_mass) else None
    need_mass = [
        top_ps[row] + _PREFIX_MASS_MARGIN if by_mass[i] else math.inf
        for i, row in enumerate(filtered)
    ]
    ids, counts = ranked_prefix(
        logits, probs, k, torch.tensor(need_mass, dtype=torch.float64, device=device)
    )
    top_p = torch.tensor([top_ps[row] for row in filtered], dtype=scaled.dtype, device=device)
    if all(by_mass) and _native_rows(logits):
        # Top-p alone: the float32 decisions and the scatter of _ranked_keep in one native
        # pass a row over the prefix, not six [rows, width] ops and a [rows, vocab] scatter.
        kept = torch.ops.deepwell_sampling.top_p_keep(logits, probs, ids, counts, top_p)
    else:
        kept = _ranked_keep(logits, probs, ids, counts, k, by_mass, top_p)
    if len(filtered) == rows:
        return kept
    out = scaled.clone()
    out[filtered] = kept
    return out


def _ranked_keep(
    logits: torch.Tensor,
    probs: torch.Tensor | None,
    ids: torch.Tensor,
    counts: torch.Tensor,
    k: torch.Tensor,
    by_mass: list[bool],
    top_p: torch.Tensor,
) -> torch.Tensor:
    """nucleus_logits' rows with their ranked prefixes `ids`, `counts`: -inf past each row's
    top-k, and past its top-p within the ranked softmax (or, `by_mass` rows, within the
    vocabulary's softmax `probs`)."""
    device = logits.device
    positions = torch.arange(ids.shape[1], device=device)
    beyond = positions >= torch.minimum(counts, k)[:, None]
    values = logits.gather(1, ids)
    ranked_probs = None
    if not all(by_mass):
        # The full sort's softmax over its first k ranked logits: the prefix is at least 16
        # wide (or the whole vocabulary), where torch sums it as it summed the whole row.
        ranked_probs = values.masked_fill(beyond, float("-inf")).softmax(dim=-1)
    if probs is not None:
        mass_probs = probs.gather(1, ids).masked_fill(beyond, 0.0)
        if ranked_probs is None:
            ranked_probs = mass_probs
        else:
            mass_rows = torch.tensor(by_mass, device=device)[:, None]
            ranked_probs = torch.where(mass_rows, mass_probs, ranked_probs)
    # Drop a token when the mass before it already reaches top_p; the first always stays.
    mass_before = ranked_probs.cumsum(dim=-1) - ranked_probs
    remove = beyond | (mass_before >= top_p[:, None])
    # Padding repeats a row's first id, which always stays: it writes that id's own logit.
    padding = positions >= counts[:, None]
    written = values.masked_fill(remove & ~padding, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, ids, written)


@functools.cache
def _native_sampling() -> bool:
    """Whether torch.ops.deepwell_sampling is registered (the kernel built); logs once if not."""
    loaded = load_sampling_kernel()
    if loaded.module is None:
        logger.warning("sampling scans through torch ops (slower): %s", loaded.reason)
    return loaded.module is not None


def _native_rows(tensor: torch.Tensor) -> bool:
    """Whether the native sampling ops take these rows (float32 on the CPU, the kernel built)."""
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and _native_sampling()


def ranked_prefix(
    scaled: torch.Tensor,
    probs: torch.Tensor | None,
    need_count: torch.Tensor,
    need_mass: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the ids of its first tokens in stable descending order of `scaled` (ids
    [rows, width], padded) and how many there are: at least the first `need_count`, or the
    first holding `need_mass` of `probs` (float64 sums). The native kernel orders only such a
    prefix (layers/ranked_prefix.cpp); elsewhere (another device, no kernel, a NaN) torch's
    stable sort orders the whole row."""
    rows, vocab = scaled.shape
    if _native_rows(scaled):
        mass = probs if probs is not None else scaled.new_empty(0)
        ids, counts = torch.ops.deepwell_sampling.ranked_prefix(scaled, mass, need_count, need_mass)
        if not bool((counts < 0).any()):
            return ids, counts
    order = scaled.sort(dim=-1, descending=True, stable=True).indices
    return order, torch.full((rows,), vocab, dtype=torch.long, device=scaled.device)


def token_distribution(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Per row, the probabilities its token is chosen from, summing to 1: a sampled
    request's after temperature, top-k, top-p and min-p; a greedy one's (no temperature to
    sharpen by) the softmax of its logits. `logits` already carry masks and penalties."""
    probs = logits.softmax(dim=-1)
    sampled_rows = [row for row, r in enumerate(requests) if not r.params.greedy]
    if sampled_rows:
        filtered = filtered_probs(logits[sampled_rows], [requests[i] for i in sampled_rows])
        # min-p zeroes tokens without renormalising (inverse_cdf scales by the total).
        probs[sampled_rows] = filtered / filtered.sum(dim=-1, keepdim=True)
    return probs


def sum_smaller_probs(probs: torch.Tensor, token_ids: list[int]) -> list[float]:
    """Per row, the sum of the probabilities at most the chosen token's, itself included
    (float64 sums of float32 probabilities)."""
    probs = probs.double()
    ids = torch.tensor(token_ids, dtype=torch.long, device=probs.device).unsqueeze(1)
    chosen = probs.gather(1, ids)
    return probs.masked_fill(probs > chosen, 0.0).sum(dim=-1).tolist()


def token_logprobs(row: torch.Tensor, token_id: int, top: int) -> TokenLogprobs:
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        # top_logprobs may exceed a small vocabulary (up to 1000 are allowed).
        values, ids = row.topk(min(top, row.shape[-1]))
        alternatives = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token_id, row[token_id].item(), alternatives)


def sampler_for(kernels: str) -> Sampler:
    """The sampler of a kernel set (`--kernels`, settings/engine.py KERNEL_SETS)."""
    if kernels == "triton":
        # Imported here: it needs Triton, which only this kernel set asks for.
        from deepwell.engine.layers.triton.sampling import TritonSampler

        return TritonSampler()
    return Sampler()
