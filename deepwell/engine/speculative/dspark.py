"""DSparkDrafter: drafts from DeepSeek-V4.1's own draft stages (spec/deepseek_v41.md §3.6).

One batched pass of the stages over every proposing request's block [x_a, NOISE, ...] gives
per-position base logits; then, position by position, the Markov head adds the transition
bias of the token drafted before (the anchor x_a first), a token is drawn (argmax for greedy
requests; otherwise from the request's filtered distribution with the counter-based uniform
of case 1, spec/deepinfer.md §1.6), and the confidence head gives the probability that the
target accepts it. Survival is the running product of those confidences.
"""

import torch

from deepwell.engine.device import HOST
from deepwell.engine.kv.cache import KVCache
from deepwell.engine.models.deepseek_v41.dspark import DSPARK_RING
from deepwell.engine.request import Request
from deepwell.engine.sampling import filtered_probs, inverse_cdf, uniform
from deepwell.engine.speculative.drafter import Draft, Drafter

# The uniform case of a draft token's draw (DeepInfer's next-n case).
DRAFT_CASE = 1


class DSparkDrafter(Drafter):
    def __init__(
        self, model: torch.nn.Module, kv_cache: KVCache, temperatures: tuple[float, ...]
    ) -> None:
        """model: DeepseekV41ForCausalLM built with DSpark (its context rings in kv_cache);
        temperatures: the confidence head's, one for all positions or one per position."""
        self.model = model
        self.dspark = model.hooks().draft_stages
        self.rings = kv_cache.rings[DSPARK_RING]
        self.ring_rows = self.rings[0].shape[1]
        self.max_tokens = self.dspark.block_size
        self.temperatures = temperatures

    def _temperature(self, position: int) -> float:
        # One value for every position, or one per position (the last one beyond the list).
        return self.temperatures[min(position, len(self.temperatures) - 1)]

    @torch.inference_mode()
    def propose(self, requests: list[Request], rooms: list[int]) -> list[Draft | None]:
        # From the host's lists; the block moves them to the model's device.
        anchors = torch.tensor([r.token_ids[-1] for r in requests], dtype=torch.long, device=HOST)
        positions = torch.tensor([r.num_tokens - 1 for r in requests], device=HOST)
        normed, hidden = self.dspark.block(
            self.model.embed,
            anchors,
            positions,
            [r.slot for r in requests],
            self.rings,
            self.ring_rows,
            self.model.dtype,
        )
        # The head only for the positions some request has room to draft.
        width = min(max(rooms), self.max_tokens)
        base = self.model.compute_logits(normed[:, :width])
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        sampled_requests = [requests[i] for i in sampled]
        previous = anchors
        tokens = []
        confidences = []
        probs = []
        for k in range(width):
            transition, embedding = self.dspark.markov(previous)
            logits = base[:, k] + transition
            drawn = logits.argmax(dim=-1)
            if sampled:
                q = filtered_probs(logits[sampled], sampled_requests)
                # Draft k takes position num_tokens + k, as the verify row that checks it.
                draws = [uniform(r.seed, r.num_tokens + k, DRAFT_CASE) for r in sampled_requests]
                drawn[sampled] = inverse_cdf(q, draws)
                probs.append(q)
            confidence = self.dspark.confidence(hidden[:, k], embedding)
            confidences.append(torch.sigmoid(confidence / self._temperature(k)))
            tokens.append(drawn)
            previous = drawn
        token_rows = torch.stack(tokens, 1).tolist()
        survival_rows = torch.stack(confidences, 1).cumprod(dim=1).tolist()
        # Request index → its row of the sampled requests' distributions [n, width, vocab].
        prob_rows = dict(zip(sampled, torch.stack(probs, 1), strict=True)) if sampled else {}
        drafts: list[Draft | None] = []
        for index, room in enumerate(rooms):
            n = min(room, width)
            draft = Draft(token_rows[index][:n], survival=survival_rows[index][:n])
            if index in prob_rows:
                draft.probs = prob_rows[index][:n]
            drafts.append(draft)
        return drafts

    def forget(self, request_id: str) -> None:
        """Nothing per request lives outside the KV cache's rings."""
