"""Engine worker process: receives typed requests over ZeroMQ, steps the engine, streams tokens back.

Run as `python -m deepwell.serve.worker CONFIG` (a hex msgpack `WorkerConfig`), so the HTTP
process never imports torch. Inputs are drained before every step: an abort takes effect
within one engine step.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Protocol

import zmq

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.args import env_flag
from deepwell.engine.structured import StructuredOutput
from deepwell.serve.messages import (
    AbortRequest,
    GenerateRequest,
    ModelInfo,
    RequestRejected,
    Shutdown,
    StepOutputs,
    TokenOutput,
    WorkerConfig,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
    decode_message,
    encode_message,
)

# While idle the worker wakes this often to notice a dead parent.
IDLE_POLL_MS = 200


class StepEngine(Protocol):
    """What the worker loop needs from an engine: requests in, one step at a time, tokens out.

    `add_request` raises ValueError for a request the engine refuses.
    """

    def add_request(self, request: GenerateRequest) -> None: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[TokenOutput]: ...

    def stats(self) -> WorkerStats: ...

    def model_info(self) -> ModelInfo: ...


def serve_engine(
    engine: StepEngine,
    worker_id: int,
    inbox: zmq.Socket,
    outbox: zmq.Socket,
    parent_pid: int | None = None,
) -> None:
    """Run the worker loop until a `Shutdown` arrives or the parent process is gone."""
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    last_stats = engine.stats()
    outbox.send(encode_message(WorkerReady(worker_id, engine.model_info(), last_stats)))
    while True:
        busy = engine.has_unfinished()
        poller.poll(0 if busy else IDLE_POLL_MS)
        rejected = []
        while True:
            try:
                message = decode_message(inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if isinstance(message, Shutdown):
                return
            if isinstance(message, GenerateRequest):
                try:
                    engine.add_request(message)
                except ValueError as error:
                    rejected.append(RequestRejected(message.request_id, str(error)))
            elif isinstance(message, AbortRequest):
                engine.abort(message.request_ids)
            else:
                raise TypeError(f"worker cannot handle {type(message).__name__}")
        if parent_pid is not None and os.getppid() != parent_pid:
            return
        outputs = engine.step() if engine.has_unfinished() else []
        stats = engine.stats()
        if outputs or rejected or stats != last_stats:
            outbox.send(encode_message(StepOutputs(worker_id, outputs, rejected, stats)))
            last_stats = stats


class EngineCoreAdapter:
    """`StepEngine` over deepwell's `EngineCore`: protocol messages ↔ engine calls."""

    def __init__(self, config: WorkerConfig) -> None:
        self._core = EngineCore(
            EngineArgs(
                model=config.model_path,
                max_num_seqs=config.max_num_seqs,
                memory_gib=config.memory_gib,
                max_model_len=config.max_model_len,
                block_size=config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                num_speculative_tokens=config.num_speculative_tokens,
                kv_store_path=config.kv_store_path,
                kv_store_capacity_gib=config.kv_store_capacity_gib,
                kv_store_ttl_chat_s=config.kv_store_ttl_chat_s,
                kv_store_ttl_agent_s=config.kv_store_ttl_agent_s,
                batch_invariant=config.batch_invariant or env_flag("DEEPWELL_BATCH_INVARIANT"),
                async_scheduling=config.async_scheduling,
                quantize_kv_cache=config.quantize_kv_cache,
                quantization=config.quantization,
                num_threads=config.num_threads,
            )
        )

    def add_request(self, request: GenerateRequest) -> None:
        structured = request.structured_output
        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop_token_ids=list(request.stop_token_ids),
            logprobs=request.top_logprobs is not None,
            top_logprobs=request.top_logprobs or 0,
            structured_output=None
            if structured is None
            else StructuredOutput(
                structured.kind, structured.spec, tuple(structured.trigger_token_ids)
            ),
        )
        self._core.add_request(
            request.request_id, request.prompt_token_ids, params, request.cache_class
        )

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self._core.has_unfinished()

    def step(self) -> list[TokenOutput]:
        return [
            TokenOutput(
                request_id=output.request_id,
                token_ids=output.new_token_ids,
                finish_reason=output.finish_reason.value if output.finish_reason else None,
                prompt_tokens=output.num_prompt_tokens,
                cached_prompt_tokens=output.num_cached_tokens,
                logprobs=[(lp.logprob, list(lp.top)) for lp in output.new_logprobs] or None,
                error=output.error,
            )
            for output in self._core.step()
        ]

    def stats(self) -> WorkerStats:
        stats = self._core.stats()
        return WorkerStats(
            stats.running,
            stats.waiting,
            stats.kv_blocks_used,
            stats.kv_blocks_total,
            prefix_queried_tokens=stats.prefix_queried_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            store_hits=stats.store_hits,
            store_misses=stats.store_misses,
            store_read_bytes=stats.store_read_bytes,
            store_written_bytes=stats.store_written_bytes,
            store_errors=stats.store_errors,
            spec_decode_steps=stats.spec.decode_steps,
            spec_verified_tokens=stats.spec.verified_tokens,
            spec_accepted_tokens=stats.spec.accepted_tokens,
            spec_position_accept_rates=list(stats.spec.position_accept_rates),
            spec_confidence_error=stats.spec.confidence_error,
        )

    def close(self) -> None:
        """Write out queued KV store blocks; the next worker may want them."""
        self._core.close()

    def model_info(self) -> ModelInfo:
        core = self._core
        return ModelInfo(
            name=core.model_name,
            architecture=core.architecture,
            context_limit=core.max_model_len,
            tokenizer_json=core.tokenizer.to_str(),
            chat_template=core.chat_template,
            eos_token_ids=sorted(core.eos_token_ids),
        )


def main(config: WorkerConfig) -> None:
    """Process entry point: load the engine, then serve it until told to stop."""
    # The parent owns shutdown: it finishes or aborts in-flight requests, then sends
    # `Shutdown`. A Ctrl-C reaching the whole process group must not kill us first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind(config.inbox_address)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 1000)
    outbox.connect(config.outbox_address)
    try:
        engine = EngineCoreAdapter(config)
        try:
            serve_engine(engine, config.worker_id, inbox, outbox, config.parent_pid)
        finally:
            engine.close()
    except Exception as error:  # the frontend must learn why its worker is gone
        message = f"{type(error).__name__}: {error}"
        outbox.send(encode_message(WorkerFailed(config.worker_id, message)))
        raise
    finally:
        inbox.close(linger=0)
        outbox.close()
        context.term()


if __name__ == "__main__":
    main(decode_message(bytes.fromhex(sys.argv[1])))
