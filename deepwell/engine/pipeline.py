"""StepPipeline: launch a planned step's forward, then sample it and commit its tokens.

With asynchronous scheduling the forward runs on a compute thread and one step stays in
flight between calls: `advance` samples step N, launches step N+1 (a request's input there
is the token step N is sampling, filled in at launch) and commits step N's tokens while N+1
computes. Requests that end meanwhile keep their blocks until the step in flight is done.
"""

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from deepwell.engine.compute_thread import start_compute_thread
from deepwell.engine.kv.manager import KVCacheManager
from deepwell.engine.outputs import RequestOutput
from deepwell.engine.request import Request, RequestStatus
from deepwell.engine.runner import ModelRunner, PreparedStep, SampledChunks
from deepwell.engine.scheduler import Scheduler, SchedulerOutput
from deepwell.engine.speculative import Speculator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    """What a step computed: prefill tokens (chunks) and decode tokens."""

    prefill_tokens: int = 0
    decode_tokens: int = 0


@dataclass
class LaunchedStep:
    """A step handed to the forward: its inputs and its logits to come."""

    prepared: PreparedStep
    stats: StepStats
    # (logits of the step's logit rows, seconds the forward took)
    result: Future
    # Requests that ended while the step computed: their blocks are freed once it is done.
    release: list[Request] = field(default_factory=list)


class StepPipeline:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        kv: KVCacheManager,
        speculator: Speculator | None,
        requests: dict[str, Request],
        async_scheduling: bool | None,
    ) -> None:
        """`async_scheduling` None: on with one torch thread only (below)."""
        self.runner = runner
        self.scheduler = scheduler
        self.kv = kv
        self.speculator = speculator
        # The engine's table of unfinished requests: an ended request leaves it here.
        self.requests = requests
        # Once two threads have run parallel torch ops, libgomp has more threads than cores
        # and stops spinning between parallel regions, which slows every small op on a quiet
        # machine: on 2 cores with 2 torch threads, batch-1 decode fell from 100 to 70 tok/s
        # with the forward on its own thread. So by default the CPU loop overlaps only with
        # one torch thread (docs/benchmarks.md, "asynchronous scheduling with DSpark").
        threads = torch.get_num_threads()
        if async_scheduling is None:
            async_scheduling = threads == 1
            if not async_scheduling:
                logger.info(
                    "asynchronous scheduling pays with one torch thread only (%d in use): "
                    "the step loop runs synchronously (--async-scheduling forces it)",
                    threads,
                )
        self.async_scheduling = async_scheduling
        self._compute = start_compute_thread() if self.async_scheduling else None
        self.in_flight: LaunchedStep | None = None
        self.num_steps = 0
        # Seconds of model work (forward, logits, sampling): over wall time, how busy it is.
        self.compute_s = 0.0
        # What the step finished by the last `step()` call computed.
        self.last_step = StepStats()

    def advance(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Launch the planned step and hand back the tokens of the step before it; the new
        step stays in flight only where it may overlap the next call's planning."""
        outputs = []
        prepared = self.runner.prepare(plan.chunks) if plan.chunks else None
        previous, self.in_flight = self.in_flight, None
        sampled = self._collect(previous) if previous is not None else None
        if prepared is not None:
            self.in_flight = self._launch(prepared, _step_stats(plan), previous, sampled)
        if previous is not None:
            outputs += self._commit(previous, sampled)
            self._release(previous)
        if self.in_flight is not None and (
            not self.async_scheduling or any(c.draft for c in plan.chunks)
        ):
            # A verified draft decides how many tokens its request gains: nothing can be
            # planned on top of it.
            outputs += self.drain()
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight: wait for it, sample it, hand back its tokens."""
        launched, self.in_flight = self.in_flight, None
        outputs = self._commit(launched, self._collect(launched))
        self._release(launched)
        return outputs

    def finish(self, request: Request) -> None:
        """Take an ended request out; a step in flight may still write its blocks."""
        self.release(request)
        del self.requests[request.request_id]
        if self.speculator is not None:
            self.speculator.forget(request.request_id)

    def release(self, request: Request) -> None:
        """Take a request out of scheduling and free its blocks once no step writes them."""
        in_flight = self.in_flight
        self.scheduler.finish(request, free_blocks=in_flight is None)
        if in_flight is not None:
            in_flight.release.append(request)

    def close(self) -> None:
        """Finish the step in flight and stop the compute thread."""
        if self.in_flight is not None:
            self.drain()
        if self._compute is not None:
            self._compute.shutdown()

    def _launch(
        self,
        prepared: PreparedStep,
        stats: StepStats,
        previous: LaunchedStep | None,
        sampled: SampledChunks | None,
    ) -> LaunchedStep:
        """Start the step's forward, its pending inputs taken from the step just sampled."""
        pending = {}
        if prepared.pending_rows:
            completed = [c.request.request_id for c in previous.prepared.chunks if c.completes]
            pending = {
                request_id: tokens[-1]
                for request_id, tokens in zip(completed, sampled.tokens, strict=True)
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
        return LaunchedStep(prepared, stats, result)

    def _forward(self, prepared: PreparedStep, pending: dict[str, int]):
        started = time.perf_counter()
        logits = self.runner.forward(prepared, pending)
        return logits, time.perf_counter() - started

    def _collect(self, launched: LaunchedStep) -> SampledChunks:
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

    def _release(self, launched: LaunchedStep) -> None:
        """Free the blocks of requests that ended while the step computed."""
        for request in launched.release:
            self.kv.free(request)

    def _commit(self, launched: LaunchedStep, sampled: SampledChunks) -> list[RequestOutput]:
        """Append a finished step's tokens, check stops, and make its KV findable."""
        outputs = []
        samples = iter(
            zip(sampled.tokens, sampled.logprobs, sampled.sum_smaller_probs, strict=True)
        )
        snapshots = launched.prepared.snapshots
        for chunk in launched.prepared.chunks:
            request = chunk.request
            snapshot = snapshots.get(request.request_id) if snapshots else None
            # Tokens whose KV the step wrote; a request preempted meanwhile holds no blocks.
            computed = min(chunk.start + chunk.num_tokens, request.num_tokens)
            new_tokens, token_logprobs, sums = next(samples) if chunk.completes else ([], None, [])
            # A prefill chunk, or a request aborted or ended while the step computed.
            if not chunk.completes or request.status is RequestStatus.FINISHED:
                if request.block_ids:
                    self.kv.commit(request, computed, snapshot)
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
                self.kv.commit(request, computed + accepted, snapshot)
            new_logprobs = [] if token_logprobs is None else [token_logprobs]
            request.logprobs += new_logprobs
            if request.finish_reason is not None:
                self.finish(request)
            outputs.append(request.step_output(appended, new_logprobs, sums[: len(appended)]))
        return outputs


def _step_stats(plan: SchedulerOutput) -> StepStats:
    decode_tokens = sum(1 for c in plan.chunks if c.num_tokens == 1 and c.completes)
    return StepStats(plan.num_tokens - decode_tokens, decode_tokens)
