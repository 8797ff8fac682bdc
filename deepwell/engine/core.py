"""EngineCore: the step loop (schedule → execute → update) over token-id requests.

`add_request`, `abort` and `step` are called from one thread; `AsyncEngine` (stream.py)
wraps them for asyncio callers. The model and its KV cache come from build.py, requests enter
through intake.py, and pipeline.py launches, samples and commits each step. With asynchronous
scheduling the forward runs on a compute thread: while step N computes, `step()` schedules
and prepares step N+1, then samples step N, launches step N+1 and hands back step N's tokens
while N+1 computes. Outputs are the same with it on or off: sampling reads only the
request's own state, which is up to date before each sample.
"""

import logging
import time
from collections.abc import Sequence

import torch

from deepwell.engine.args import EngineArgs
from deepwell.engine.build import BuiltEngine, build_engine, check_expert_parallel
from deepwell.engine.decode_graphs import decode_graphs_for
from deepwell.engine.device import resolve_device
from deepwell.engine.encoder_cache import EncoderCache, from_image_embedding
from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.intake import RequestIntake
from deepwell.engine.logit_filter import LogitFilter
from deepwell.engine.multimodal import ImageEmbedding, ImageInput
from deepwell.engine.outputs import FinishReason, RequestOutput
from deepwell.engine.parallel.context import launch_context_parallel
from deepwell.engine.parallel.eplb import EplbState
from deepwell.engine.parallel.group import init_group
from deepwell.engine.parallel.lockstep import StepGate
from deepwell.engine.pipeline import StepPipeline, StepStats
from deepwell.engine.request import Request
from deepwell.engine.runner import ModelRunner
from deepwell.engine.sampling import sampler_for
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.scheduler import Scheduler
from deepwell.engine.speculative import Speculator
from deepwell.engine.speculative.cadence import DraftCadence
from deepwell.engine.speculative.dspark import DSparkDrafter
from deepwell.engine.speculative.ngram import NgramDrafter
from deepwell.engine.stats import EngineStats, SpecStats
from deepwell.engine.watchdog import StallWatchdog

logger = logging.getLogger(__name__)
# An idle step loop whose waiting requests all read the KV store sleeps at most this long.
_LOAD_POLL_S = 0.005
# An idle step loop with only compiling requests sleeps at most this long per step.
_COMPILE_POLL_S = 0.005


class EngineCore:
    def __init__(self, args: EngineArgs) -> None:
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        # Expert parallelism: join the group before loading (a rank loads only its experts).
        self.group = None
        if args.parallel.expert_parallel:
            check_expert_parallel(args)
            self.group = init_group(args.parallel, resolve_device(args.device))
        built = build_engine(args, self.group)
        self.model_config = built.model_config
        self.model_name = built.model_name
        self.architecture = built.architecture
        self.tokenizer = built.tokenizer
        self.chat_template = built.chat_template
        self.vocab_size = built.vocab_size
        self.eos_token_ids = built.eos_token_ids
        self.bos_token_id = built.bos_token_id
        self.max_model_len = built.max_model_len
        self.kv = built.kv
        self.scheduler = Scheduler(
            self.kv,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            # Outside batch-invariant mode a draft the budget cannot hold is cut rather
            # than deferred: its request still decodes this step.
            whole_drafts=args.batch_invariant,
            max_prefill_keys=args.prefill_max_sum_seqlen_k,
            chunked_prefill=args.chunked_prefill,
        )
        # Rank 0 of a context-parallel group: long prefills run across the group.
        self.context_parallel = None
        model = built.model
        if args.context_parallel_size > 1:
            model = self.context_parallel = launch_context_parallel(built.model, args)
        self.runner = _model_runner(model, built, args, self.group is not None)
        self.speculator = _speculator(built, args)
        self.draft_cadence = DraftCadence(every_step=args.batch_invariant)
        # Unfinished requests by id: intake adds them; the pipeline, or an abort, ends them.
        self.requests: dict[str, Request] = {}
        self.pipeline = StepPipeline(
            self.runner,
            self.scheduler,
            self.kv,
            self.speculator,
            self.requests,
            # Expert-parallel steps are collectives agreed on this thread: no overlap.
            args.async_scheduling if self.group is None else False,
        )
        self.async_scheduling = self.pipeline.async_scheduling
        self.intake = RequestIntake(args, built, self.scheduler, self.requests)
        self._aborted: list[RequestOutput] = []
        self.num_preemptions = 0
        self.watchdog = StallWatchdog(
            args.stuck_request_timeout_s, self.requests, self.scheduler, self.intake.compiling
        )
        self.num_stuck_ended = 0
        self.logging_interval_step = args.logging_interval_step
        self._logged_step = 0
        self._logged_at = time.monotonic()
        self.lockstep = None
        if self.group is not None:
            eplb = args.parallel
            self.lockstep = StepGate(
                self.group,
                built.model.hooks().routed_experts.layers,
                EplbState(
                    eplb.eplb_window_steps,
                    eplb.eplb_min_gain,
                    eplb.eplb_step_interval or eplb.eplb_window_steps,
                )
                if eplb.enable_eplb
                else None,
            )

    @property
    def num_steps(self) -> int:
        """Steps launched (callers may reset it, e.g. after a warm-up)."""
        return self.pipeline.num_steps

    @num_steps.setter
    def num_steps(self, value: int) -> None:
        self.pipeline.num_steps = value

    @property
    def compute_s(self) -> float:
        """Seconds of model work (forward, logits, sampling): over wall time, how busy it is."""
        return self.pipeline.compute_s

    @property
    def last_step(self) -> StepStats:
        """What the step finished by the last `step()` call computed."""
        return self.pipeline.last_step

    def validate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: Sequence[ImageInput] = (),
    ) -> None:
        """Raise InvalidRequestError if the request cannot be served; changes nothing."""
        self.intake.validate(prompt_token_ids, params, images)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_class: str = "chat",
        images: Sequence[ImageInput] = (),
    ) -> None:
        """`cache_class` ("chat" or "agent") picks the KV store TTL of the request's blocks;
        `images` fill their spans of the prompt (multimodal.py), on a model with a vision
        tower."""
        self.intake.add(request_id, prompt_token_ids, params, cache_class, images)

    def provide_image_embeddings(self, embeddings: Sequence[ImageEmbedding]) -> None:
        """Embeddings an encoder worker computed, held in the encoder cache by content hash,
        so the requests whose images they are read them instead of running the tower."""
        cache = self.runner.encoder_cache
        if embeddings and cache is None:
            raise InvalidRequestError(
                "image embeddings were sent to an engine without a vision tower", "images"
            )
        for embedding in embeddings:
            cache.put(embedding.content_hash, from_image_embedding(embedding, self.runner.device))

    def abort(self, request_id: str) -> bool:
        """Stop a request at once and free its blocks; False if it is not in flight."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._end(request, FinishReason.ABORT)
        return True

    def _end(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """Take a request out wherever it is and hand back its last output at the next step."""
        if request.request_id in self.requests:
            if not self.intake.withdraw(request):
                self.pipeline.finish(request)
        else:  # astray: held by the scheduler alone (watchdog.py)
            self.pipeline.release(request)
        request.finish_reason = reason
        request.error = error
        self._aborted.append(request.step_output([], []))

    def close(self) -> None:
        """Finish the step in flight, write queued blocks to the KV store, stop threads and
        context-parallel ranks."""
        self.pipeline.close()
        if self.kv.store is not None:
            self.kv.store.close()
        if self.group is not None:
            self.group.close()
        if self.context_parallel is not None:
            self.context_parallel.close()

    def has_unfinished(self) -> bool:
        # The scheduler's lists too: a request held there alone must still reach a step,
        # where the watchdog ends it (the loop must never idle beside held blocks).
        return (
            bool(self.requests)
            or self.scheduler.has_work
            or bool(self._aborted)
            or self.pipeline.in_flight is not None
        )

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
            stuck_requests_ended=self.num_stuck_ended,
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
        """One round: admit compiled requests, propose drafts, schedule, then launch the plan
        and hand back what the step before it sampled."""
        self._end_stranded()
        outputs, self._aborted = self._aborted, []
        if self.intake.compiling:
            outputs += self.intake.admit_compiled()
        if self.speculator is not None:
            outputs += self._propose_drafts()
        plan = self.scheduler.schedule()
        self.num_preemptions += len(plan.preempted)
        if (
            self.lockstep is not None
            and self.lockstep.agree(bool(plan.chunks), self.has_unfinished())
            and not plan.chunks
        ):
            self.lockstep.dummy_step()
            return outputs
        if plan.chunks or self.pipeline.in_flight is not None:
            outputs += self.pipeline.advance(plan)
            self._log_stats()
            return outputs
        # Nothing to compute: wait for a store read or a compile rather than spin.
        self.scheduler.wait_for_loads(_LOAD_POLL_S)
        if self.intake.compiling and not outputs:
            self.intake.wait_for_compile(_COMPILE_POLL_S)
        return outputs

    def _end_stranded(self) -> None:
        """End, with an error each client sees, the requests the watchdog finds stranded."""
        for stranded in self.watchdog.check(time.monotonic()):
            self.num_stuck_ended += 1
            message = f"the engine stopped making progress on this request: it {stranded.reason}"
            self._end(stranded.request, FinishReason.STUCK, message)

    def _log_stats(self) -> None:
        """A line of statistics every `logging_interval_step` steps (DeepInfer's
        LOGGING_INTERVAL_STEP, spec/deepinfer.md §1.7)."""
        steps = self.pipeline.num_steps
        interval = self.logging_interval_step
        if interval <= 0 or steps % interval or steps == self._logged_step:
            return
        now = time.monotonic()
        rate = (steps - self._logged_step) / max(now - self._logged_at, 1e-9)
        self._logged_step, self._logged_at = steps, now
        stats = self.stats()
        logger.info(
            "step %d: %.1f steps/s, running %d, waiting %d, KV blocks %d/%d, prefix hit "
            "tokens %d/%d, preemptions %d, draft accept rate %.2f",
            steps,
            rate,
            stats.running,
            stats.waiting,
            stats.kv_blocks_used,
            stats.kv_blocks_total,
            stats.prefix_hit_tokens,
            stats.prefix_queried_tokens,
            stats.num_preemptions,
            stats.spec.accept_rate,
        )

    def _propose_drafts(self) -> list[RequestOutput]:
        """Give running requests drafts for the next step, first draining the step in flight
        (it hides their last tokens) unless the cadence lets it overlap."""
        in_flight = self.pipeline.in_flight is not None
        if not self.draft_cadence.propose_now(in_flight):
            return []
        outputs = self.pipeline.drain() if in_flight else []
        running = self.scheduler.running
        self.speculator.propose(running, self.scheduler.max_num_batched_tokens)
        self.draft_cadence.record(any(request.draft_token_ids for request in running))
        return outputs


def _model_runner(
    model: torch.nn.Module, built: BuiltEngine, args: EngineArgs, expert_parallel: bool
) -> ModelRunner:
    """The runner of `model` (the built one, or its context-parallel wrapper)."""
    return ModelRunner(
        model,
        built.kv_cache,
        args.block_size,
        args.batch_invariant,
        built.layout,
        built.replay,
        built.kv.snapshots,
        device=built.device,
        sampler=sampler_for(args.kernels),
        encoder_cache=_encoder_cache(built),
        decode_graphs=decode_graphs_for(
            built.device,
            args.enforce_eager,
            args.max_num_seqs,
            expert_parallel,
            -(-built.max_model_len // args.block_size),
            built.model.hooks().graph_blocker,
        ),
        logit_filter=LogitFilter.of(
            args.sampler_force_topk, args.decode_token_blacklist, built.vocab_size
        ),
        sum_smaller_probs=args.compute_sum_smaller_probs,
        # A context-parallel wrapper steps its own way.
        fixed_plans=model is built.model and built.model.hooks().fixed_decode_plans,
    )


def _speculator(built: BuiltEngine, args: EngineArgs) -> Speculator | None:
    """Drafts and verification, when the model speculates; verify lengths from each request
    alone unless enable_mtp_varlen, and always in batch-invariant mode (DeepInfer's
    MTP_VARLEN, spec/deepinfer.md §1.6; speculative/planner.py)."""
    if built.speculative_method is None:
        return None
    drafter = (
        DSparkDrafter(built.model, built.kv_cache, args.dspark_confidence_temperature)
        if built.speculative_method == "dspark"
        else NgramDrafter()
    )
    limit = built.layout.max_draft_tokens(args.num_speculative_tokens)
    return Speculator(
        min(limit, drafter.max_tokens or limit),
        drafter,
        args.batch_invariant,
        variable_length=args.enable_mtp_varlen,
    )


def _encoder_cache(built: BuiltEngine) -> EncoderCache | None:
    encoder = built.model.hooks().image_encoder
    return None if encoder is None else EncoderCache(encoder)
