"""Lossless verification of a draft against the target model's rows.

A point-mass draft (n-gram lookup, greedy drafts: q = 1 on the drafted token) is checked
against the target's own draw: each verify row draws with the sampler's counter-based
uniform for its position, and the draft token is accepted while it equals that draw.
Acceptance has probability p(d), the rejection-sampling optimum for a point mass, every
emitted token is exactly the target's sample, and a seeded request gets the same tokens
with speculation on or off.

A draft that carries its distributions q (DSpark on a sampled request) follows the
speculative-sampling rule: accept d with probability min(1, p(d)/q(d)), resample the first
rejection from norm(max(0, p − q)), and add a bonus token from p when all are accepted
(spec/deepinfer.md §1.6). Its uniforms are counter-based too: case 1 of a position drew the
draft token, case 2 is its acceptance test and case 0 the target's draw, so a seeded request
replays exactly for the same verify lengths. A request with a grammar gets its mask on
every verify row, the matcher advanced through the draft and rolled back after.
"""

import numpy as np
import torch

from deepwell.engine.request import Request
from deepwell.engine.sampling import filtered_probs, first_argmax, inverse_cdf, uniform
from deepwell.engine.structured import apply_masks

# The uniform of a position's acceptance test (cases 0 and 1 are the target's and the
# draft's draws, sampling.uniform).
ACCEPT_CASE = 2


def verify(
    logits: torch.Tensor,
    draft: list[int],
    request: Request,
    draft_probs: torch.Tensor | None = None,
    greedy_targets: list[int] | None = None,
) -> list[int]:
    """logits: [len(draft) + 1, vocab] float32, row i predicting the token after draft[:i];
    draft_probs: [len(draft), vocab], the distributions the draft was drawn from (None:
    point masses); greedy_targets: the rows' argmax, when the caller took it for many
    requests' rows at once (`takes_batched_argmax`).

    Returns the accepted draft tokens followed by one token of the target's.
    """
    proposed = draft
    if request.matcher is not None:
        draft = _apply_grammar(logits, draft, request)
        logits = logits[: len(draft) + 1]
    if draft_probs is not None and not request.params.greedy:
        return _speculative_sampling(logits, proposed, len(draft), draft_probs, request)
    if request.params.greedy:
        if greedy_targets is not None and takes_batched_argmax(request):
            targets = greedy_targets
        else:
            targets = first_argmax(logits).tolist()
    else:
        probs = filtered_probs(logits, [request] * logits.shape[0])
        # Row i samples the token at position num_tokens + i of the sequence.
        draws = [uniform(request.seed, request.num_tokens + i) for i in range(len(draft) + 1)]
        targets = inverse_cdf(probs, draws).tolist()
    accepted = 0
    while accepted < len(draft) and targets[accepted] == draft[accepted]:
        accepted += 1
    return draft[:accepted] + [targets[accepted]]


def takes_batched_argmax(request: Request) -> bool:
    """Whether a request's verify rows are checked against their raw argmax: greedy, with no
    grammar masking its rows first. One blocked argmax over every such row of a step costs a
    fraction of one `argmax` call per request (sampling.first_argmax)."""
    return request.params.greedy and request.matcher is None


def _speculative_sampling(
    logits: torch.Tensor,
    draft: list[int],
    allowed: int,
    draft_probs: torch.Tensor,
    request: Request,
) -> list[int]:
    """The rule over draft tokens whose first `allowed` the grammar permits: the next one,
    if any, has p = 0 under the mask and is rejected (resampled from the residual, not from
    p, which would bias the emitted token toward what q favoured)."""
    probs = filtered_probs(logits, [request] * logits.shape[0])
    for i in range(min(len(draft), allowed + 1)):
        position = request.num_tokens + i
        token = draft[i]
        p, q = probs[i], draft_probs[i].to(probs.dtype)
        if i < allowed and uniform(request.seed, position, ACCEPT_CASE) * q[token] < p[token]:
            continue
        residual = (p - q).clamp(min=0)
        if not residual.sum() > 0:
            # p ≤ q everywhere means p = q up to rounding: the residual is p itself.
            residual = p
        resampled = inverse_cdf(residual.unsqueeze(0), [uniform(request.seed, position)])
        return draft[:i] + [int(resampled)]
    position = request.num_tokens + len(draft)
    bonus = inverse_cdf(probs[len(draft) : len(draft) + 1], [uniform(request.seed, position)])
    return draft + [int(bonus)]


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
