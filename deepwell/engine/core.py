"""EngineCore: the step loop (schedule → execute → update) over token-id requests.

`add_request`, `abort` and `step` are called from one thread; `AsyncEngine` (stream.py)
wraps them for asyncio callers.
"""

import logging
import random
import time
from dataclasses import dataclass

import torch

from deepwell.engine.args import EngineArgs
from deepwell.engine.errors import InvalidRequestError, MemoryBudgetError
from deepwell.engine.kv.cache import KVCache, plan_num_blocks
from deepwell.engine.kv.manager import KVCacheManager
from deepwell.engine.kv.slot_pool import num_slots_for
from deepwell.engine.layers.torch_paged import TorchPagedAttention
from deepwell.engine.models.loader import load_checkpoint
from deepwell.engine.models.registry import build_model
from deepwell.engine.outputs import FinishReason, RequestOutput
from deepwell.engine.request import Request
from deepwell.engine.runner import ModelRunner
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int


@dataclass(frozen=True)
class StepStats:
    """What the last step computed: prefill tokens (chunks) and decode tokens."""

    prefill_tokens: int = 0
    decode_tokens: int = 0


class EngineCore:
    def __init__(self, args: EngineArgs) -> None:
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        started = time.monotonic()
        checkpoint = load_checkpoint(args.model)
        model = build_model(
            checkpoint.architecture, checkpoint.hf_config, TorchPagedAttention, args.torch_dtype
        )
        model.load_weights(checkpoint.tensors)
        model.eval()
        self.model_config = model.config
        self.model_name = checkpoint.path.stem
        self.architecture = checkpoint.architecture
        self.tokenizer = checkpoint.tokenizer
        self.chat_template = checkpoint.chat_template
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = frozenset(model.config.eos_token_ids)
        self.max_model_len = min(
            args.max_model_len or model.config.max_position_embeddings,
            model.config.max_position_embeddings,
        )
        layout = model.kv_layout()
        num_slots = num_slots_for(args.max_num_seqs)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        num_blocks = args.num_kv_blocks or plan_num_blocks(
            layout,
            memory_gib=args.memory_gib,
            model_bytes=model_bytes,
            block_size=args.block_size,
            num_slots=num_slots,
            dtype=args.torch_dtype,
            max_model_len=self.max_model_len,
        )
        if num_blocks * args.block_size < self.max_model_len:
            raise MemoryBudgetError(
                f"{num_blocks} KV blocks of {args.block_size} tokens cannot hold one "
                f"{self.max_model_len}-token sequence; raise num_kv_blocks or lower max_model_len"
            )
        kv_cache = KVCache.allocate(
            layout, num_blocks, args.block_size, num_slots, args.torch_dtype
        )
        self.kv = KVCacheManager(layout, num_blocks, args.block_size, num_slots)
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens)
        self.runner = ModelRunner(model, kv_cache, args.block_size)
        self.requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._seeds = random.Random(args.seed)
        self.num_steps = 0
        self.num_preemptions = 0
        self.last_step = StepStats()
        logger.info(
            "loaded %s (%s, %s) in %.1fs; %d KV blocks of %d tokens",
            checkpoint.path.name,
            checkpoint.architecture,
            args.dtype,
            time.monotonic() - started,
            num_blocks,
            args.block_size,
        )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if the request cannot be served; changes nothing."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"expected SamplingParams, got {type(params).__name__}")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [
            t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise InvalidRequestError(
                f"prompt has {len(bad)} token id(s) outside the vocabulary [0, {self.vocab_size}), "
                f"e.g. {bad[0]!r}"
            )
        total = len(prompt_token_ids) + params.max_tokens
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt of {len(prompt_token_ids)} tokens does not fit the context of "
                f"{self.max_model_len} tokens"
            )
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds the context of {self.max_model_len} tokens"
            )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self.eos_token_ids
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            stop_token_ids=frozenset(stop),
            generator=torch.Generator().manual_seed(seed),
        )
        self.requests[request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        """Stop a request at once and free its blocks; False if it is not in flight."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request)
        request.finish_reason = FinishReason.ABORT
        self._aborted.append(_output(request, [], []))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    def stats(self) -> EngineStats:
        pool = self.kv.block_pool
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=pool.num_blocks - pool.num_free,
            kv_blocks_total=pool.num_blocks,
            num_preemptions=self.num_preemptions,
        )

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        plan = self.scheduler.schedule()
        self.num_preemptions += len(plan.preempted)
        if not plan.chunks:
            return outputs
        decode_tokens = sum(1 for c in plan.chunks if c.num_tokens == 1 and c.completes)
        self.last_step = StepStats(plan.num_tokens - decode_tokens, decode_tokens)
        tokens, logprobs = self.runner.execute(plan.chunks)
        self.num_steps += 1
        sampled = iter(zip(tokens, logprobs, strict=True))
        for chunk in plan.chunks:
            request = chunk.request
            completes = chunk.completes
            request.num_computed_tokens += chunk.num_tokens
            if not completes:
                continue
            token, token_logprobs = next(sampled)
            request.append_token(token)
            new_logprobs = [] if token_logprobs is None else [token_logprobs]
            request.logprobs += new_logprobs
            if request.finish_reason is not None:
                self.scheduler.finish(request)
                del self.requests[request.request_id]
            outputs.append(_output(request, [token], new_logprobs))
        return outputs


def _output(request: Request, new_tokens: list[int], new_logprobs) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_tokens,
        new_logprobs=new_logprobs,
        finished=request.finish_reason is not None,
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
    )
