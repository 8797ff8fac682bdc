"""RequestIntake: check a request against the model, build its state, admit it to scheduling.

A request with structured output waits here while its grammar compiles off the step loop,
and joins scheduling only once its matcher is ready: the decode loop never waits for a compile.
"""

import random
from collections.abc import Sequence

import torch

from deepwell.engine.args import EngineArgs
from deepwell.engine.build import BuiltEngine
from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.kv.store import CACHE_CLASSES
from deepwell.engine.multimodal import ImageInput, check_images, image_spans
from deepwell.engine.outputs import FinishReason, RequestOutput
from deepwell.engine.request import Request, RequestStatus
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.scheduler import Scheduler
from deepwell.engine.structured import (
    GrammarCompiler,
    GrammarError,
    PendingGrammar,
    grammar_tokenizer,
)


class RequestIntake:
    """The way into the engine's table of unfinished requests (`requests`, shared with the core)."""

    def __init__(
        self,
        args: EngineArgs,
        built: BuiltEngine,
        scheduler: Scheduler,
        requests: dict[str, Request],
    ) -> None:
        self.vocab_size = built.vocab_size
        self.max_model_len = built.max_model_len
        self.bounded_replay = built.replay.bounded
        self.eos_token_ids = built.eos_token_ids
        self.scheduler = scheduler
        self.requests = requests
        self.grammars = _grammar_compiler(args, built) if built.tokenizer is not None else None
        # Requests whose grammar is compiling, by id: in `requests`, not yet scheduled.
        self.compiling: dict[str, PendingGrammar] = {}
        self._seeds = random.Random(args.seed)
        self.image_encoder = built.model.hooks().image_encoder
        self.context_parallel = args.context_parallel_size > 1

    def validate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: Sequence[ImageInput] = (),
    ) -> None:
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
        named = [*params.stop_token_ids, *params.logit_bias, *(params.golden_token_ids or ())]
        if params.first_n_token_no_eos:
            named.append(params.eos_id)
        outside = [t for t in named if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if outside:
            raise InvalidRequestError(
                f"stop_token_ids / logit_bias / golden_token_ids / eos_id name token id "
                f"{outside[0]!r}, outside the vocabulary [0, {self.vocab_size})"
            )
        if params.wants_prompt_logprobs and self.bounded_replay:
            # The consumer layers' rows before the kept suffix are skipped or see a narrowed
            # window, so their logits are not the model's.
            raise InvalidRequestError(
                "prompt_logprobs needs yoco_prefill_truncation_mode 'off'", "prompt_logprobs"
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
        if images:
            self._check_images(prompt_token_ids, images)
        structured = params.structured_output
        if structured is not None:
            if self.grammars is None:
                raise InvalidRequestError("structured output needs a model with a tokenizer")
            marks = [*structured.trigger_token_ids, structured.bound_token_id or 0]
            if max(marks) >= self.vocab_size:
                raise InvalidRequestError(
                    f"structured output trigger or bound token outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )

    def _check_images(self, prompt_token_ids: list[int], images: Sequence[ImageInput]) -> None:
        encoder = self.image_encoder
        if encoder is None:
            raise InvalidRequestError(
                f"the request has {len(images)} image(s) (image 0 first) but this model has "
                "no vision tower: send text only",
                param="images",
            )
        if self.context_parallel:
            raise InvalidRequestError(
                "images are not served with context parallelism; send text only",
                param="images",
            )
        check_images(
            images,
            prompt_token_ids,
            encoder.image_token_id,
            encoder.downsample_ratio,
            encoder.patch_size,
        )

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_class: str,
        images: Sequence[ImageInput] = (),
    ) -> None:
        """Validate, build the request, and schedule it (or start its grammar's compile)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if cache_class not in CACHE_CLASSES:
            raise InvalidRequestError(
                f"cache class must be one of {', '.join(CACHE_CLASSES)}, got {cache_class!r}"
            )
        self.validate(prompt_token_ids, params, images)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self.eos_token_ids
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            stop_token_ids=frozenset(stop),
            generator=torch.Generator().manual_seed(seed),
            seed=seed,
            cache_class=cache_class,
        )
        if images:
            request.images = tuple(images)
            request.image_spans = image_spans(images, self.image_encoder.downsample_ratio)
        if params.structured_output is not None:
            # Raises GrammarError for a spec too large or malformed to start compiling.
            self.compiling[request_id] = self.grammars.submit(params.structured_output)
            request.status = RequestStatus.COMPILING
        else:
            self.scheduler.add(request)
        self.requests[request_id] = request

    def admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is ready join scheduling; failed compiles end their request."""
        failed = []
        for request_id, pending in list(self.compiling.items()):
            request = self.requests[request_id]
            try:
                matcher = pending.matcher(request.stop_token_ids)
            except GrammarError as error:
                failed.append(self._end_compiling(request, str(error)))
                continue
            if matcher is None:
                continue
            replay = request.params.grammar_replay_token_ids
            if not all(matcher.advance(token_id) for token_id in replay):
                message = f"the resumed output does not fit its grammar: {matcher.error}"
                failed.append(self._end_compiling(request, message))
                continue
            del self.compiling[request_id]
            request.matcher = matcher
            request.status = RequestStatus.WAITING
            self.scheduler.add(request)
        return failed

    def _end_compiling(self, request: Request, error: str) -> RequestOutput:
        del self.compiling[request.request_id], self.requests[request.request_id]
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.ERROR
        request.error = error
        return request.step_output([], [])

    def withdraw(self, request: Request) -> bool:
        """End a request still compiling its grammar; False if it is past intake."""
        if self.compiling.pop(request.request_id, None) is None:
            return False
        del self.requests[request.request_id]
        request.status = RequestStatus.FINISHED
        return True

    def wait_for_compile(self, timeout_s: float) -> None:
        """Block until a compile finishes or `timeout_s` passes (an idle step loop)."""
        self.grammars.wait(list(self.compiling.values()), timeout_s)


def _grammar_compiler(args: EngineArgs, built: BuiltEngine) -> GrammarCompiler:
    tokenizer, vocab_size = built.tokenizer, built.vocab_size
    eos = min(built.eos_token_ids) if built.eos_token_ids else None
    return GrammarCompiler(
        lambda: grammar_tokenizer(tokenizer, vocab_size, eos),
        timeout_s=args.grammar_compile_timeout_s,
    )
