"""Lossless verification of a draft against the target model's rows.

Drafts are point masses (q = 1 on the drafted token). Each verify row draws the target's
own token with the sampler's counter-based uniform for its position, and the draft token
is accepted while it equals that draw: acceptance has probability p(d), the rejection
sampling optimum for a point-mass draft, the token emitted at every position is exactly
the target's sample, and a seeded request gets the same tokens with speculation on or
off (spec/deepinfer.md §1.6). A bonus token follows a fully accepted draft.
"""

import torch

from deepwell.engine.request import Request
from deepwell.engine.sampling import filtered_probs, inverse_cdf, uniform


def verify(logits: torch.Tensor, draft: list[int], request: Request) -> list[int]:
    """logits: [len(draft) + 1, vocab] float32, row i predicting the token after draft[:i].

    Returns the accepted draft tokens followed by one token of the target's.
    """
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
