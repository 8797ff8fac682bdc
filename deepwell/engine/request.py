"""Request: one generation's state, under the one contract of the scheduler.

`num_computed_tokens` catches up with `token_ids` (prompt, then outputs); prefill chunks,
decodes and recompute after preemption are all "how far is the counter". The scheduler
moves the counter when it schedules a chunk, so a step still computing counts as done,
and a token that step will sample counts as pending (asynchronous scheduling).
"""

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from deepwell.engine.multimodal import ImageInput
from deepwell.engine.outputs import FinishReason, RequestOutput, TokenLogprobs
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.structured.matcher import GrammarMatcher


class RequestStatus(enum.Enum):
    # Its grammar compiles; it joins scheduling once the matcher is ready.
    COMPILING = "compiling"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Stop ids the request ends on: its own plus the model's EOS unless ignore_eos.
    stop_token_ids: frozenset[int]
    generator: torch.Generator
    # 64-bit sampling seed (the caller's or a random one): with the position, it fixes
    # every draw (sampling.uniform).
    seed: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # When a step last gave it tokens to compute (scheduler.py); the watchdog's clock.
    last_scheduled: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Tokens a scheduled step will sample for this request and has not yet handed back.
    num_pending_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Per-sequence state slot, for layouts with rings or states.
    slot: int | None = None
    # Traffic class: picks the KV store TTL of the blocks this request writes.
    cache_class: str = "chat"
    # The prompt's images, in prompt order, and the span each fills: (first position, end
    # position, content hash).
    images: tuple[ImageInput, ...] = ()
    image_spans: tuple[tuple[int, int, str], ...] = ()
    # Prefix keys of the full blocks of token_ids, extended as blocks fill (kv/prefix.py).
    block_keys: list[bytes] = field(default_factory=list)
    # Leading blocks already findable by key (hits, or committed after being computed).
    num_committed_blocks: int = 0
    # Tokens the last admission took from the prefix cache instead of computing them.
    num_cached_tokens: int = 0
    # First position the YOCO consumer layers' window sees (kv/replay.py), set at admission;
    # 0 when exact.
    replay_start: int = 0
    # Blocks the KV store had for this prompt, by key: each a list of tensors, one per
    # paged spec and layer (KVCache.read_blocks order). Copied into the cache on admission.
    stored_blocks: dict[bytes, list[torch.Tensor]] = field(default_factory=dict)
    # The ring snapshot the KV store had at the end of those blocks (at most one), by key.
    stored_snapshots: dict[bytes, list[torch.Tensor]] = field(default_factory=dict)
    # The store read of stored_blocks and stored_snapshots, until admission collects it.
    store_load: Future | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Why the request failed, with finish_reason ERROR.
    error: str | None = None
    matcher: GrammarMatcher | None = None
    # Draft tokens to verify after the last token in the next step (speculative/); never
    # part of token_ids, so prefix keys and the counter cover accepted tokens only.
    draft_token_ids: list[int] = field(default_factory=list)
    # [len(draft_token_ids), vocab]: the distributions the draft tokens were drawn from
    # (DSpark on a sampled request); None for point-mass drafts.
    draft_probs: torch.Tensor | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Logprobs of prompt tokens 1, 2, ... as their rows are computed (prompt_logprobs);
    # handed out once, with the first output.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    num_preemptions: int = 0
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_expected_tokens(self) -> int:
        """The token count once the pending samples land: what the scheduler plans for."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if self.matcher is not None and not self.matcher.advance(token_id):
            self.finish_reason = FinishReason.ERROR
            self.error = f"the output left its grammar: {self.matcher.error}"
        elif token_id in self.stop_token_ids:
            self.finish_reason = FinishReason.STOP
        elif self.num_output_tokens >= self.params.max_tokens:
            self.finish_reason = FinishReason.LENGTH

    def step_output(
        self,
        new_token_ids: list[int],
        new_logprobs: list[TokenLogprobs],
        new_sum_smaller_probs: list[float] | None = None,
    ) -> RequestOutput:
        """What the request gained in a step, and whether it has ended (and on which stop id)."""
        stopped_by_token = (
            self.finish_reason is FinishReason.STOP
            and bool(new_token_ids)
            and new_token_ids[-1] in self.stop_token_ids
        )
        prompt_logprobs = []
        if self.prompt_logprobs and not self.prompt_logprobs_sent:
            prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            seed=self.seed,
            stop_token_id=new_token_ids[-1] if stopped_by_token else None,
            prompt_logprobs=prompt_logprobs,
            new_sum_smaller_probs=new_sum_smaller_probs or [],
        )
