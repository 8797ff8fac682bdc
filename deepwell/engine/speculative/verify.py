"""Lossless verification of a draft against the target model's rows.

Drafts are point masses (q = 1 on the drafted token). Each verify row draws the target's
own token with the sampler's counter-based uniform for its position, and the draft token
is accepted while it equals that draw: acceptance has probability p(d), the rejection
sampling optimum for a point-mass draft, the token emitted at every position is exactly
the target's sample, and a seeded request gets the same tokens with speculation on or
off (spec/deepinfer.md §1.6). A bonus token follows a fully accepted draft. A request
with a grammar gets its mask on every verify row, the matcher advanced through the draft
and rolled back after.
"""

import numpy as np
import torch

from deepwell.engine.request import Request
from deepwell.engine.sampling import filtered_probs, inverse_cdf, uniform
from deepwell.engine.structured import apply_masks


def verify(logits: torch.Tensor, draft: list[int], request: Request) -> list[int]:
    """logits: [len(draft) + 1, vocab] float32, row i predicting the token after draft[:i].

    Returns the accepted draft tokens followed by one token of the target's.
    """
    if request.matcher is not None:
        draft = _apply_grammar(logits, draft, request)
        logits = logits[: len(draft) + 1]
    if request.params.greedy:
        targets = logits.argmax(dim=-1).tolist()
    else:
        probs = filtered_probs(logits, [request] * logits.shape[0])
        # Row i samples the token at position num_tokens + i of the sequence.
        draws = [uniform(request.seed, request.num_tokens + i) for i in range(len(draft) + 1)]
        targets = inverse_cdf(probs, draws).tolist()
    accepted = 0
    while accepted < len(draft) and targets[accepted] == draft[accepted]:
        accepted += 1
    return draft[:accepted] + [targets[accepted]]


def _apply_grammar(logits: torch.Tensor, draft: list[int], request: Request) -> list[int]:
    """Mask each verify row in place with the grammar state after the draft before it;
    returns the draft cut at its first token the grammar forbids (never accepted anyway)."""
    matcher = request.matcher
    masks = np.empty((len(draft) + 1, (logits.shape[-1] + 31) // 32), dtype=np.uint32)
    rows: list[int] = []
    advanced = 0
    for row in range(len(draft) + 1):
        if matcher.constrains_next:
            matcher.fill_mask(masks[len(rows)])
            rows.append(row)
            token = draft[row] if row < len(draft) else None
            if token is not None and not masks[len(rows) - 1][token >> 5] >> (token & 31) & 1:
                draft = draft[:row]
                break
        if row == len(draft):
            break
        advanced += 1
        if not matcher.advance(draft[row]):
            draft = draft[:row]
            break
    matcher.rollback(advanced)
    if rows:
        apply_masks(logits, rows, masks[: len(rows)])
    return draft
