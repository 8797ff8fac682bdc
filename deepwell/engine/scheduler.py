"""Scheduler: continuous batching under a token budget, chunked prefill, preemption.

Every request's `num_computed_tokens` catches up with its token list; a step gives each
running request (oldest first), then waiting ones, as many tokens as the budget allows.
When blocks run out the newest running request is preempted and later recomputed. A
request entering the running set starts its counter after its prefix-cache hit.

Scheduling a chunk moves the counter at once, and a chunk that reaches the end of the
token list adds a pending token: the next step can be planned while this one computes,
with the pending token as its input (asynchronous scheduling, core.py).
"""

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

from deepwell.engine.kv.manager import KVCacheManager
from deepwell.engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    request: Request
    # Positions [start, start + num_tokens) run this step; the last may be a pending token.
    start: int
    num_tokens: int
    # The chunk reaches the end of the token list, so the step samples a token for it.
    completes: bool
    # Draft tokens verified after them (extra query rows), for a chunk that completes.
    draft: list[int] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return self.num_tokens + len(self.draft)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def num_rows(self) -> int:
        return sum(chunk.num_rows for chunk in self.chunks)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        whole_drafts: bool = False,
        max_prefill_keys: int | None = None,
        chunked_prefill: bool = True,
    ):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Batch-invariant mode: a draft the step's budget left cannot hold waits for the
        # next step whole, so its verify length never depends on the other requests.
        self.whole_drafts = whole_drafts
        # DeepInfer's PREFILL_MAX_SUM_SEQLEN_K: the key positions a step's prefill chunks
        # attend over together (each its start plus its tokens); None: no cap.
        self.max_prefill_keys = max_prefill_keys
        self._prefill_keys = 0
        # Off (DeepInfer's offline default): a waiting request is admitted only when its
        # whole remaining prompt fits the step's budget left, else it waits (FIFO).
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.kv.prefetch(request)
        self.waiting.append(request)

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block until a waiting request's stored prefix has loaded, or `timeout_s`."""
        pending = [r.store_load for r in self.waiting if r.store_load is not None]
        if pending:
            wait(pending, timeout_s, FIRST_COMPLETED)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        self._prefill_keys = 0
        # A running request passed over for the step's budget or key cap counts as scheduled
        # for the watchdog (watchdog.py): it waits on others' progress, not on nothing.
        now = time.monotonic()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.num_output_tokens + request.num_pending_tokens >= request.params.max_tokens:
                index += 1  # its pending token is its last
                continue
            wanted = min(request.num_expected_tokens - request.num_computed_tokens, budget)
            num_tokens = self._fit_keys(request.num_computed_tokens, wanted)
            if not num_tokens:
                if wanted:
                    request.last_scheduled = now
                index += 1
                continue
            if self.kv.cuts_chunks:
                num_tokens = self.kv.snapshot_cut(request, request.num_computed_tokens, num_tokens)
            target = request.num_computed_tokens + num_tokens
            draft = request.draft_token_ids if num_tokens == 1 else []
            if len(draft) > budget - num_tokens:
                if self.whole_drafts:
                    request.last_scheduled = now
                    index += 1
                    continue
                draft = draft[: budget - num_tokens]
            # A draft never preempts anyone: it runs only where blocks are free.
            if draft and self.kv.can_allocate(request, target + len(draft)):
                target += len(draft)
            else:
                draft = []
            while not self.kv.can_allocate(request, target):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            self.kv.allocate(request, target)
            chunks.append(self._take(request, num_tokens, draft))
            budget -= num_tokens + len(draft)
            index += 1
        for request in self.running[index:]:
            request.last_scheduled = now  # the budget ran out before its turn
        # Admitting new work right after a preemption would only thrash the cache.
        index = 0
        while not preempted and index < len(self.waiting) and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[index]
            # Waiting requests hold no blocks (new, or preempted): look for a prefix hit.
            # A preempted one whose last token is still being sampled waits for it.
            hit = None if request.num_pending_tokens else self.kv.find_prefix(request)
            if hit is None:
                index += 1  # its stored prefix is still loading; the next may go first
                continue
            num_tokens = min(request.num_tokens - hit.num_tokens, budget)
            if not self.chunked_prefill and num_tokens < request.num_tokens - hit.num_tokens:
                break
            num_tokens = self._fit_keys(hit.num_tokens, num_tokens)
            if not num_tokens:
                break
            if self.kv.cuts_chunks:
                num_tokens = self.kv.snapshot_cut(request, hit.num_tokens, num_tokens)
            if not self.kv.can_allocate(request, hit.num_tokens + num_tokens, hit):
                break
            del self.waiting[index]
            self.kv.admit(request, hit, hit.num_tokens + num_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.append(self._take(request, num_tokens, []))
            budget -= num_tokens
        return SchedulerOutput(chunks, preempted)

    def _fit_keys(self, start: int, num_tokens: int) -> int:
        """A prefill chunk's tokens cut to the step's key cap; 0: it waits. The step's first
        prefill chunk runs whole, so that a prompt longer than the cap still advances."""
        cap = self.max_prefill_keys
        if cap is None or num_tokens <= 1:
            return num_tokens
        if self._prefill_keys:
            num_tokens = min(num_tokens, cap - self._prefill_keys - start)
            if num_tokens < 1:
                return 0
        self._prefill_keys += start + num_tokens
        return num_tokens

    @staticmethod
    def _take(request: Request, num_tokens: int, draft: list[int]) -> ScheduledChunk:
        """The chunk of a request's next `num_tokens` tokens, counted as computed from now."""
        start = request.num_computed_tokens
        completes = start + num_tokens == request.num_expected_tokens
        request.num_computed_tokens += num_tokens
        request.num_pending_tokens += completes
        request.last_scheduled = time.monotonic()
        return ScheduledChunk(request, start, num_tokens, completes, draft)

    def _preempt(self, request: Request) -> None:
        # Recompute, not swap: the tokens stay, the KV goes, the counter restarts.
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def finish(self, request: Request, free_blocks: bool = True) -> None:
        """Take a request out of scheduling (finished or aborted) and free its KV, unless
        a step still computing writes to it: then the caller frees it afterwards."""
        # A request the watchdog ends may be on neither list (watchdog.py).
        queue = self.running if request.status is RequestStatus.RUNNING else self.waiting
        if request in queue:
            queue.remove(request)
        if free_blocks:
            self.kv.free(request)
        request.status = RequestStatus.FINISHED
