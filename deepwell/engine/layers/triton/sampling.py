"""Seeded sampling in Triton: temperature, top-k / top-p / min-p and the inverse-CDF draw of each
row's counter-based uniform, so a seed gives the tokens of the torch sampler (engine/sampling.py).

The top-k / top-p set is the torch sampler's (engine/sampling.py `nucleus_logits`, torch ops on
the device); the kernel reads the logits left outside it as -inf and draws in vocabulary order,
as the torch path does.
"""

from __future__ import annotations

import torch

from deepwell.engine.layers.triton import require_triton
from deepwell.engine.request import Request
from deepwell.engine.sampling import Sampler, nucleus_logits

triton = require_triton()
tl = triton.language

_BLOCK = 1024


@triton.jit
def _draw_kernel(
    logits_ptr,  # [rows, vocab] float32, scaled by temperature, -inf outside top-k / top-p
    min_p_ptr,
    uniform_ptr,  # [rows] float64
    token_ptr,  # [rows] int64 out
    vocab,
    block: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * vocab
    # Pass 1: the kept logits' maximum and softmax denominator (carried across blocks).
    # The lowest float32, not -inf: a first block with nothing kept then scales by exp(0).
    running_max = -3.4028234663852886e38
    total = 0.0
    for start in range(0, vocab, block):
        ids = start + tl.arange(0, block)
        kept = ids < vocab
        scaled = tl.load(logits_ptr + base + ids, mask=kept, other=float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scaled, axis=0))
        total = total * tl.exp(running_max - new_max) + tl.sum(tl.exp(scaled - new_max), axis=0)
        running_max = new_max
    # min-p keeps probabilities of at least min_p times the largest, exp(0) / total.
    floor = tl.load(min_p_ptr + row) * (1.0 / total)
    # Pass 2: the float64 mass left after min-p; pass 3: where the uniform falls in its CDF.
    mass = tl.zeros((), tl.float64)
    last_with_mass = -1
    for start in range(0, vocab, block):
        ids = start + tl.arange(0, block)
        kept = ids < vocab
        scaled = tl.load(logits_ptr + base + ids, mask=kept, other=float("-inf"))
        probs = tl.where(kept, tl.exp(scaled - running_max) / total, 0.0)
        probs = tl.where(probs < floor, 0.0, probs)
        mass += tl.sum(probs.to(tl.float64), axis=0)
        last_with_mass = tl.maximum(last_with_mass, tl.max(tl.where(probs > 0, ids, -1), axis=0))
    target = tl.load(uniform_ptr + row) * mass
    before = tl.zeros((), tl.float64)
    token = vocab
    for start in range(0, vocab, block):
        ids = start + tl.arange(0, block)
        kept = ids < vocab
        scaled = tl.load(logits_ptr + base + ids, mask=kept, other=float("-inf"))
        probs = tl.where(kept, tl.exp(scaled - running_max) / total, 0.0)
        probs = tl.where(probs < floor, 0.0, probs).to(tl.float64)
        cdf = before + tl.cumsum(probs, axis=0)
        crossing = tl.min(tl.where((cdf > target) & (ids < vocab), ids, vocab), axis=0)
        token = tl.minimum(token, crossing)
        before += tl.sum(probs, axis=0)
    # u * mass rounding up to the mass: the last token with mass, as inverse_cdf does.
    token = tl.where(token >= vocab, last_with_mass, token)
    tl.store(token_ptr + row, token.to(tl.int64))


def draw(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ks: list[int],
    top_ps: list[float],
    min_ps: list[float],
    uniforms: list[float],
) -> torch.Tensor:
    """Per row of float32 `logits`, the token its uniform draws after temperature, top-k,
    top-p and min-p: engine/sampling.py's filtered_probs then inverse_cdf."""
    rows, vocab = logits.shape
    device = logits.device

    def column(values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    temperature = column(temperatures, torch.float32)
    scaled = nucleus_logits(logits.float() / temperature[:, None], top_ks, top_ps).contiguous()
    tokens = torch.empty(rows, dtype=torch.long, device=device)
    _draw_kernel[(rows,)](
        scaled,
        column(min_ps, torch.float32),
        column(uniforms, torch.float64),
        tokens,
        vocab,
        block=min(_BLOCK, triton.next_power_of_2(vocab)),
    )
    return tokens


class TritonSampler(Sampler):
    """The sampler of `--kernels triton`: greedy rows, penalties and grammar masks as the torch
    sampler, the sampled rows drawn in the Triton kernel."""

    def draw(self, logits: torch.Tensor, requests: list[Request], uniforms: list[float]):
        params = [r.params for r in requests]
        return draw(
            logits,
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
            uniforms,
        )
