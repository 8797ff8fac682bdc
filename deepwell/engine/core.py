"""EngineCore: the step loop (schedule → execute → update) over token-id requests.

`add_request`, `abort` and `step` are called from one thread; `AsyncEngine` (stream.py)
wraps them for asyncio callers.

With asynchronous scheduling the forward runs on a compute thread: while step N computes,
`step()` schedules and prepares step N+1 (a request's input there is the token step N is
sampling, filled in at launch), then samples step N, launches step N+1 and hands back step
N's tokens while N+1 computes.
Requests that end meanwhile keep their blocks until the step in flight is done. Outputs
are the same with it on or off: sampling reads only the request's own state, which is up
to date before each sample.
"""

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from deepwell.engine.args import EngineArgs
from deepwell.engine.build import build_engine
from deepwell.engine.compute_thread import start_compute_thread
from deepwell.engine.intake import RequestIntake
from deepwell.engine.outputs import FinishReason, RequestOutput
from deepwell.engine.request import Request, RequestStatus
from deepwell.engine.runner import ModelRunner, PreparedStep
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.scheduler import Scheduler, SchedulerOutput
from deepwell.engine.speculative import SpecStats, Speculator

logger = logging.getLogger(__name__)
# An idle step loop whose waiting requests all read the KV store sleeps at most this long.
_LOAD_POLL_S = 0.005
# An idle step loop with only compiling requests sleeps at most this long per step.
_COMPILE_POLL_S = 0.005
# With speculation and asynchronous scheduling both on, a step in flight hides its
# requests' last tokens from the drafter, and a verify step must finish before the next is
# planned: drafting wins, overlap takes the lulls. The loop stays synchronous while drafts
# keep coming (they come and go: on repetitive text a hit every other step is common, and
# overlapping after 8 misses cost a fifth of batch-1 decode speed). After this many
# proposals in a row find none, steps overlap...
_PROPOSALS_BEFORE_OVERLAP = 32
# ...and every this many overlapped steps the loop drains once to look for drafts again.
_DRAFT_PROBE_INTERVAL = 8


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    # Prompt tokens looked up in the prefix cache at admission, and those it supplied
    # (from memory or the KV store).
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    store_hits: int = 0
    store_misses: int = 0
    store_read_bytes: int = 0
    store_written_bytes: int = 0
    # Unreadable, corrupt, truncated or foreign block files, and dropped writes.
    store_errors: int = 0
    # Speculative decoding (speculative/): request-steps that decoded, draft positions
    # verified and accepted, per-position acceptance and the confidence error.
    spec: SpecStats = field(default_factory=SpecStats)


@dataclass(frozen=True)
class StepStats:
    """What a step computed: prefill tokens (chunks) and decode tokens."""

    prefill_tokens: int = 0
    decode_tokens: int = 0


@dataclass
class _LaunchedStep:
    """A step handed to the forward: its inputs and its logits to come."""

    prepared: PreparedStep
    stats: StepStats
    # (logits of the step's logit rows, seconds the forward took)
    result: Future
    # Requests that ended while the step computed: their blocks are freed once it is done.
    release: list[Request] = field(default_factory=list)


class EngineCore:
    def __init__(self, args: EngineArgs) -> None:
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        built = build_engine(args)
        self.model_config = built.model_config
        self.model_name = built.model_name
        self.architecture = built.architecture
        self.tokenizer = built.tokenizer
        self.chat_template = built.chat_template
        self.vocab_size = built.vocab_size
        self.eos_token_ids = built.eos_token_ids
        self.max_model_len = built.max_model_len
        self.kv = built.kv
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens)
        self.runner = ModelRunner(
            built.model, built.kv_cache, args.block_size, args.batch_invariant
        )
        # Rollback overwrites rejected positions later; a sliding-window ring or state
        # slot would need its entries restored, so speculation runs on paged layouts only.
        # Verify lengths follow measured step times, so they vary with load: a seeded
        # request would not replay exactly, and batch-invariant mode does not speculate
        # (DeepInfer likewise needs MTP_VARLEN off for determinism, spec/deepinfer.md §1.6).
        self.speculator = (
            Speculator(args.num_speculative_tokens)
            if args.num_speculative_tokens
            and not built.layout.needs_slots
            and not args.batch_invariant
            else None
        )
        # Once two threads have run parallel torch ops, libgomp has more threads than cores
        # and stops spinning between parallel regions, which slows every small op: on 2
        # cores with 2 torch threads, batch-1 decode fell from 100 to 70 tok/s with the
        # forward on its own thread. So the CPU loop overlaps only with one torch thread.
        self.async_scheduling = args.async_scheduling and torch.get_num_threads() == 1
        if args.async_scheduling and not self.async_scheduling:
            logger.info(
                "asynchronous scheduling needs one torch thread on CPU (%d in use): "
                "the step loop runs synchronously",
                torch.get_num_threads(),
            )
        self._compute = start_compute_thread() if self.async_scheduling else None
        self._in_flight: _LaunchedStep | None = None
        self._steps_to_draft_probe = 0
        self._proposals_without_drafts = 0
        # Seconds of model work (forward, logits, sampling): over wall time, how busy it is.
        self.compute_s = 0.0
        # Unfinished requests by id: intake adds them; a finished step, or an abort, ends them.
        self.requests: dict[str, Request] = {}
        self.intake = RequestIntake(args, built, self.scheduler, self.requests)
        self._aborted: list[RequestOutput] = []
        self.num_steps = 0
        self.num_preemptions = 0
        # What the step finished by the last `step()` call computed.
        self.last_step = StepStats()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if the request cannot be served; changes nothing."""
        self.intake.validate(prompt_token_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_class: str = "chat",
    ) -> None:
        """`cache_class` ("chat" or "agent") picks the KV store TTL of the request's blocks."""
        self.intake.add(request_id, prompt_token_ids, params, cache_class)

    def abort(self, request_id: str) -> bool:
        """Stop a request at once and free its blocks; False if it is not in flight."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if not self.intake.withdraw(request):
            self._finish(request)
        request.finish_reason = FinishReason.ABORT
        self._aborted.append(request.step_output([], []))
        return True

    def close(self) -> None:
        """Finish the step in flight, write queued blocks to the KV store, stop threads."""
        if self._in_flight is not None:
            self._drain()
        if self._compute is not None:
            self._compute.shutdown()
        if self.kv.store is not None:
            self.kv.store.close()

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._aborted) or self._in_flight is not None

    def stats(self) -> EngineStats:
        pool = self.kv.block_pool
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self.intake.compiling),
            kv_blocks_used=pool.num_blocks - pool.num_free,
            kv_blocks_total=pool.num_blocks,
            num_preemptions=self.num_preemptions,
            prefix_queried_tokens=self.kv.counters.queried_tokens,
            prefix_hit_tokens=self.kv.counters.hit_tokens,
            spec=self.speculator.stats() if self.speculator is not None else SpecStats(),
            **self._store_stats(),
        )

    def _store_stats(self) -> dict[str, int]:
        store = self.kv.store
        if store is None:
            return {}
        stats = store.store.stats
        return {
            "store_hits": stats.hits,
            "store_misses": stats.misses,
            "store_read_bytes": stats.read_bytes,
            "store_written_bytes": stats.written_bytes,
            "store_errors": stats.errors + store.dropped_writes,
        }

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        if self.intake.compiling:
            outputs += self.intake.admit_compiled()
        if self.speculator is not None:
            outputs += self._propose_drafts()
        plan = self.scheduler.schedule()
        self.num_preemptions += len(plan.preempted)
        prepared = self.runner.prepare(plan.chunks) if plan.chunks else None
        previous, self._in_flight = self._in_flight, None
        sampled = self._collect(previous) if previous is not None else None
        if prepared is not None:
            self._in_flight = self._launch(prepared, _step_stats(plan), previous, sampled)
        if previous is not None:
            outputs += self._process(previous, sampled)
            self._release(previous)
        if self._in_flight is not None and (
            not self.async_scheduling or any(c.draft for c in plan.chunks)
        ):
            # A verified draft decides how many tokens its request gains: nothing can be
            # planned on top of it.
            outputs += self._drain()
        if prepared is None and previous is None:
            self.scheduler.wait_for_loads(_LOAD_POLL_S)
            if self.intake.compiling and not outputs:
                # Nothing to compute: wait for a compile rather than spin.
                self.intake.wait_for_compile(_COMPILE_POLL_S)
        return outputs

    def _propose_drafts(self) -> list[RequestOutput]:
        """Give running requests drafts for the next step, draining the step in flight
        first when it is time to look for drafts again."""
        outputs = []
        if self._in_flight is not None:
            if self._steps_to_draft_probe > 0:
                self._steps_to_draft_probe -= 1
                return outputs
            outputs = self._drain()
        running = self.scheduler.running
        self.speculator.propose(running, self.scheduler.max_num_batched_tokens)
        if any(request.draft_token_ids for request in running):
            self._proposals_without_drafts = 0
        else:
            self._proposals_without_drafts += 1
        if self._proposals_without_drafts >= _PROPOSALS_BEFORE_OVERLAP:
            self._steps_to_draft_probe = _DRAFT_PROBE_INTERVAL
        return outputs

    def _launch(
        self,
        prepared: PreparedStep,
        stats: StepStats,
        previous: _LaunchedStep | None,
        sampled: tuple[list[list[int]], list] | None,
    ) -> _LaunchedStep:
        """Start the step's forward, its pending inputs taken from the step just sampled."""
        pending = {}
        if prepared.pending_rows:
            completed = [c.request.request_id for c in previous.prepared.chunks if c.completes]
            pending = {
                request_id: tokens[-1]
                for request_id, tokens in zip(completed, sampled[0], strict=True)
                if tokens
            }
        self.num_steps += 1
        if self._compute is not None:
            result = self._compute.submit(self._forward, prepared, pending)
        else:
            result = Future()
            try:
                result.set_result(self._forward(prepared, pending))
            except Exception as error:
                result.set_exception(error)
        return _LaunchedStep(prepared, stats, result)

    def _forward(self, prepared: PreparedStep, pending: dict[str, int]):
        started = time.perf_counter()
        logits = self.runner.forward(prepared, pending)
        return logits, time.perf_counter() - started

    def _collect(self, launched: _LaunchedStep) -> tuple[list[list[int]], list]:
        """Wait for a launched step's forward and sample it. Sampling stays on this thread:
        it reads the requests' grammar state, penalties and positions, which are current
        only once the step before's tokens are appended."""
        try:
            logits, forward_s = launched.result.result()
        except Exception:
            self._release(launched)
            raise
        self.last_step = launched.stats
        started = time.perf_counter()
        sampled = self.runner.sample(launched.prepared, logits)
        step_s = forward_s + time.perf_counter() - started
        self.compute_s += step_s
        if self.speculator is not None:
            self.speculator.record_step(launched.prepared.num_rows, step_s)
        return sampled

    def _drain(self) -> list[RequestOutput]:
        """Finish the step in flight: wait for it, sample it, hand back its tokens."""
        launched, self._in_flight = self._in_flight, None
        outputs = self._process(launched, self._collect(launched))
        self._release(launched)
        return outputs

    def _release(self, launched: _LaunchedStep) -> None:
        """Free the blocks of requests that ended while the step computed."""
        for request in launched.release:
            self.kv.free(request)

    def _process(
        self, launched: _LaunchedStep, sampled: tuple[list[list[int]], list]
    ) -> list[RequestOutput]:
        """Append a finished step's tokens, check stops, and make its KV findable."""
        outputs = []
        samples = iter(zip(*sampled, strict=True))
        for chunk in launched.prepared.chunks:
            request = chunk.request
            # Tokens whose KV the step wrote; a request preempted meanwhile holds no blocks.
            computed = min(chunk.start + chunk.num_tokens, request.num_tokens)
            new_tokens, token_logprobs = next(samples) if chunk.completes else ([], None)
            # A prefill chunk, or a request aborted or ended while the step computed.
            if not chunk.completes or request.status is RequestStatus.FINISHED:
                if request.block_ids:
                    self.kv.commit(request, computed)
                continue
            request.num_pending_tokens -= 1
            if self.speculator is not None and chunk.num_tokens == 1:
                self.speculator.observe(request, len(chunk.draft), len(new_tokens) - 1)
            # Stops and max_tokens end an accepted run at the token that finishes it.
            appended = []
            for token in new_tokens:
                request.append_token(token)
                appended.append(token)
                if request.finish_reason is not None:
                    break
            # Accepted draft tokens were computed in this step, the last new token was not;
            # KV rows of rejected ones lie past the counter and are overwritten later.
            accepted = len(appended) - 1
            request.num_computed_tokens += accepted
            if request.block_ids:
                self.kv.commit(request, computed + accepted)
            new_logprobs = [] if token_logprobs is None else [token_logprobs]
            request.logprobs += new_logprobs
            if request.finish_reason is not None:
                self._finish(request)
            outputs.append(request.step_output(appended, new_logprobs))
        return outputs

    def _finish(self, request: Request) -> None:
        """Take an ended request out; a step in flight may still write its blocks."""
        in_flight = self._in_flight
        self.scheduler.finish(request, free_blocks=in_flight is None)
        if in_flight is not None:
            in_flight.release.append(request)
        del self.requests[request.request_id]
        if self.speculator is not None:
            self.speculator.forget(request.request_id)


def _step_stats(plan: SchedulerOutput) -> StepStats:
    decode_tokens = sum(1 for c in plan.chunks if c.num_tokens == 1 and c.completes)
    return StepStats(plan.num_tokens - decode_tokens, decode_tokens)
