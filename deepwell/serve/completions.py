"""The legacy OpenAI Completions endpoint (`/v1/completions`): raw prompts in, text out.

No chat encoding and no conversion: prompts are text or token ids, completed as they are.
Text and stop strings come from the same decoder and matcher as the dialects' streams
(`PlainTextStream`); what is this endpoint's own is the `text_completion` shape, echo and
its logprobs format. `n` samples per prompt (`best_of` candidates, of which the n with the
highest cumulative logprob are kept) run as Chat's `n` does (parallel_samples.py).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from deepwell.engine.outputs import FinishReason, RequestOutput
from deepwell.engine.sampling_params import SamplingParams
from deepwell.recipe import InferenceOptions, Tokenizer
from deepwell.recipe.stream.plain_text import PlainTextStream
from deepwell.serve.cluster.request_router import RequestRouter
from deepwell.serve.errors import ApiError
from deepwell.serve.frontend import sse_frame
from deepwell.serve.json_body import json_object
from deepwell.serve.messages import GenerateRequest
from deepwell.serve.metrics import RequestTimer
from deepwell.serve.model import ServedModel
from deepwell.serve.parallel_samples import MAX_SAMPLES, interleaved, sample_samplings
from deepwell.serve.sampling_fields import COMPLETIONS, read_sampling_params
from deepwell.serve.token_ids import wants_token_ids

# OpenAI's defaults and bounds for this endpoint; logprobs goes to vLLM's 20, not OpenAI's 5.
DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 4


@dataclass(frozen=True)
class CompletionRequest:
    """A checked `/v1/completions` body: one token-id list per prompt, and how to sample."""

    model: str
    prompts: list[list[int]]
    stream: bool
    include_usage: bool
    echo: bool
    # Alternatives per token; None: no logprobs.
    logprobs: int | None
    stop: list[str]
    # Budget, seed (the body's, else serve --seed, else random), stop ids (the model's
    # included) and the extra fields, checked.
    sampling: SamplingParams
    # vLLM's `return_token_ids`: each choice carries its prompt's ids and its generated ids.
    return_token_ids: bool = False
    # Choices per prompt, and candidates sampled per prompt to choose them from.
    n: int = 1
    best_of: int = 1


@dataclass
class _Choice:
    """One prompt's completion so far: its text, its tokens, and what was already sent."""

    index: int
    output: PlainTextStream
    # Which prompt this completes, and which of its candidates (best_of) it is.
    prompt_index: int = 0
    candidate: int = 0
    # The prompt's text when the request echoes it, which the output text follows.
    echo: str = ""
    # Characters of `text` already streamed.
    sent: int = 0
    finish_reason: str | None = None
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Every id generated, the stop id included (as `completion_tokens` counts them), how
    # many of them were sent, and whether the prompt's ids were.
    token_ids: list[int] = field(default_factory=list)
    ids_sent: int = 0
    prompt_ids_sent: bool = False
    # vLLM's prompt_logprobs: None for the first prompt token, then per token its id → logprob
    # and text, with the alternatives asked for; None unless the request asked.
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def text(self) -> str:
        return self.echo + self.output.text

    @property
    def cumulative_logprob(self) -> float:
        return sum(self.token_logprobs)

    @property
    def releasable(self) -> int:
        """How far the text may be sent: all of it once finished, else what is settled."""
        if self.finish_reason is not None:
            return len(self.text)
        return len(self.echo) + self.output.settled


class Completions:
    """Runs `/v1/completions` requests on engine workers for one served model.

    `seed_of` picks the seed of a request from the one its body gives (serve --seed, else
    random, when it gives none).
    """

    def __init__(
        self, model: ServedModel, engine: RequestRouter, seed_of: Callable[[int | None], int]
    ) -> None:
        if model.tokenizer is None:
            raise ValueError("completions need a model with a tokenizer")
        self.model = model
        self.tokenizer: Tokenizer = model.tokenizer
        self._engine = engine
        self._seed_of = seed_of

    def prepare(self, body: bytes) -> CompletionRequest:
        """Parse and check a body; raises ApiError naming the field at fault."""
        data = json_object(body)
        model = self._served_model_name(data)
        _refuse_unsupported(data)
        prompts = self._prompts(data.get("prompt"))
        max_tokens = _get(data, "max_tokens", DEFAULT_MAX_TOKENS)
        if max_tokens < 1:
            raise _invalid("max_tokens", ">= 1", max_tokens)
        limit = self.model.context_limit
        for prompt in prompts:
            if len(prompt) + max_tokens > limit:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                    f"{max_tokens} in the completion). Please reduce the prompt or max_tokens.",
                    param="max_tokens",
                )
        temperature = _get(data, "temperature", 1.0)
        if not 0 <= temperature <= 2:
            raise _invalid("temperature", "in [0, 2]", temperature)
        top_p = _get(data, "top_p", 1.0)
        if not 0 < top_p <= 1:
            raise _invalid("top_p", "in (0, 1]", top_p)
        logprobs = data.get("logprobs")
        if logprobs is not None and not (_is_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS):
            raise _invalid("logprobs", f"an integer in [0, {MAX_LOGPROBS}]", logprobs)
        echo = _get(data, "echo", False)
        if echo and logprobs is not None:
            raise ApiError(
                400,
                "Unsupported parameter 'echo' with 'logprobs': deepwell does not compute "
                "log-probabilities of prompt tokens.",
                param="echo",
                code="unsupported_parameter",
            )
        stream = _get(data, "stream", False)
        n, best_of = _samples(data, stream)
        options = data.get("stream_options")
        if options is not None and not (isinstance(options, dict) and stream):
            raise _invalid("stream_options", "an object, with stream = true", options)
        recipe_fields = InferenceOptions(
            temperature=temperature,
            top_p=top_p,
            logprobs=logprobs is not None,
            top_logprobs=logprobs,
        )
        sampling = read_sampling_params(
            COMPLETIONS,
            data,
            recipe_fields,
            max_tokens=max_tokens,
            fallback_seed=self._seed_of(None),
            model_stop_token_ids=self.model.stop_token_ids,
        )
        if best_of > n and not sampling.logprobs:
            # Choosing among candidates needs each token's logprob; the answer shows them
            # only when the body asked (`logprobs`).
            sampling = replace(sampling, logprobs=True, top_logprobs=0)
        return CompletionRequest(
            model=model,
            prompts=prompts,
            stream=stream,
            include_usage=bool(options and options.get("include_usage")),
            echo=echo,
            logprobs=logprobs,
            stop=_stop(data.get("stop")),
            sampling=sampling,
            return_token_ids=wants_token_ids(data),
            n=n,
            best_of=best_of,
        )

    def _served_model_name(self, data: dict[str, Any]) -> str:
        model = data.get("model")
        if not isinstance(model, str):
            raise _invalid("model", "the name of a served model", model)
        if model not in self.model.names:
            raise ApiError(
                404,
                f"The model `{model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return model

    def _prompts(self, value: Any) -> list[list[int]]:
        """A string, a list of strings, a list of token ids, or a list of such lists."""
        single_ids = isinstance(value, list) and value and all(_is_int(t) for t in value)
        if isinstance(value, str) or single_ids:
            value = [value]
        if not isinstance(value, list) or not value:
            raise _invalid("prompt", "a string, token ids, or a non-empty list of either", value)
        prompts = []
        vocab = self.tokenizer.vocab_size
        for item in value:
            if isinstance(item, str):
                ids = self.tokenizer.encode(item)
            elif isinstance(item, list) and all(_is_int(t) and 0 <= t < vocab for t in item):
                ids = item
            else:
                raise _invalid("prompt", f"strings or lists of token ids in [0, {vocab})", item)
            if not ids:
                raise _invalid("prompt", "non-empty", item)
            prompts.append(ids)
        return prompts

    async def complete(self, request: CompletionRequest, timer: RequestTimer) -> str:
        """Run every prompt to its end; the `text_completion` object as JSON."""
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        choices = self._choices(request)
        async for _ in self._run(request, choices, completion_id, timer):
            pass
        body = _envelope(completion_id, created, request.model)
        body["choices"] = [
            _choice_json(
                choice, choice.text, self._logprobs(request, choice, 0), choice.prompt_logprobs
            )
            | self._token_ids(request, choice)
            for choice in _best(choices, request.n, request.best_of)
        ]
        body["usage"] = _usage(choices)
        return json.dumps(body, ensure_ascii=False)

    async def sse(self, request: CompletionRequest, timer: RequestTimer) -> AsyncIterator[bytes]:
        """Server-sent chunks as tokens arrive, then usage (if asked) and `[DONE]`."""
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        choices = self._choices(request)
        logged = [0] * len(choices)
        async for choice in self._run(request, choices, completion_id, timer):
            delta = choice.text[choice.sent : choice.releasable]
            if not delta and choice.finish_reason is None:
                continue
            choice.sent += len(delta)
            logprobs = self._logprobs(request, choice, logged[choice.index])
            logged[choice.index] = len(choice.tokens)
            chunk = _envelope(completion_id, created, request.model)
            prompt_logprobs = None
            if not choice.prompt_logprobs_sent and choice.prompt_logprobs is not None:
                # Once per choice, in its first chunk that has them (as vLLM streams them).
                prompt_logprobs, choice.prompt_logprobs_sent = choice.prompt_logprobs, True
            chunk["choices"] = [
                _choice_json(choice, delta, logprobs, prompt_logprobs)
                | self._token_ids(request, choice)
            ]
            if request.include_usage:
                chunk["usage"] = None
            yield sse_frame(None, json.dumps(chunk, ensure_ascii=False))
        if request.include_usage:
            chunk = _envelope(completion_id, created, request.model)
            chunk["choices"] = []
            chunk["usage"] = _usage(choices)
            yield sse_frame(None, json.dumps(chunk))
        yield sse_frame(None, "[DONE]")

    def _choices(self, request: CompletionRequest) -> list[_Choice]:
        """`best_of` candidates per prompt, a prompt's consecutive; indexed as OpenAI indexes
        choices (prompt * n + sample) when every candidate is a choice."""
        return [
            _Choice(
                prompt_index * request.best_of + candidate,
                PlainTextStream(self.tokenizer, request.stop),
                prompt_index=prompt_index,
                candidate=candidate,
                echo=self.tokenizer.decode(prompt) if request.echo else "",
                prompt_tokens=len(prompt),
            )
            for prompt_index, prompt in enumerate(request.prompts)
            for candidate in range(request.best_of)
        ]

    async def _run(
        self,
        request: CompletionRequest,
        choices: list[_Choice],
        completion_id: str,
        timer: RequestTimer,
    ) -> AsyncIterator[_Choice]:
        """Every prompt on the engine at once, its first candidate first: the others start
        once it has read the prompt, and find the prompt's blocks in the prefix cache.
        Yields a choice each time it gains output."""
        samplings = sample_samplings(request.sampling, request.best_of)

        def stream(choice: _Choice) -> Callable[[], AsyncIterator[RequestOutput]]:
            async def outputs() -> AsyncIterator[RequestOutput]:
                generate = GenerateRequest(
                    f"{completion_id}-{choice.index}",
                    request.prompts[choice.prompt_index],
                    samplings[choice.candidate],
                )
                engine_outputs = self._engine.generate(generate)
                try:
                    async for output in engine_outputs:
                        yield output
                        if choice.finish_reason is not None:
                            break
                finally:
                    await engine_outputs.aclose()

            return outputs

        for choice in choices:
            if choice.candidate == 0:
                timer.prompt(choice.prompt_tokens)
        outputs = interleaved([stream(choice) for choice in choices], request.best_of)
        try:
            async for position, output in outputs:
                choice = choices[position]
                if choice.finish_reason is not None:
                    continue
                timer.output(len(output.new_token_ids))
                self._absorb(choice, output)
                yield choice
        finally:
            await outputs.aclose()

    def _absorb(self, choice: _Choice, output: RequestOutput) -> None:
        """Add an engine output to a choice: text, logprobs, and whether it ended.

        The engine's stop id ends the text without being part of it; usage counts it.
        """
        choice.completion_tokens += len(output.new_token_ids)
        choice.token_ids.extend(output.new_token_ids)
        if output.prompt_logprobs:
            choice.prompt_logprobs = [None] + [
                {
                    str(t): {"logprob": lp, "decoded_token": self.tokenizer.decode([t])}
                    for t, lp in ((entry.token_id, entry.logprob), *entry.top)
                }
                for entry in output.prompt_logprobs
            ]
        ids = output.text_token_ids
        for token_id, logprobs in zip(ids, output.text_logprobs, strict=False):
            choice.tokens.append(self.tokenizer.decode([token_id]))
            choice.token_logprobs.append(logprobs.logprob)
            choice.top_logprobs.append({self.tokenizer.decode([t]): lp for t, lp in logprobs.top})
        choice.output.push(ids)
        if output.finished:
            choice.output.finish()
            choice.finish_reason = (
                "length" if output.finish_reason is FinishReason.LENGTH else "stop"
            )
        if choice.output.stop_string is not None:
            choice.finish_reason = "stop"

    def _token_ids(self, request: CompletionRequest, choice: _Choice) -> dict:
        """The choice's ids not yet sent (and its prompt's, the first time), when asked."""
        if not request.return_token_ids:
            return {}
        ids = {"token_ids": choice.token_ids[choice.ids_sent :]}
        choice.ids_sent = len(choice.token_ids)
        if not choice.prompt_ids_sent:
            choice.prompt_ids_sent = True
            ids = {"prompt_token_ids": request.prompts[choice.index]} | ids
        return ids

    def _logprobs(self, request: CompletionRequest, choice: _Choice, first: int) -> dict | None:
        """OpenAI's completion logprobs for the choice's tokens from `first` on."""
        if request.logprobs is None:
            return None
        # Offsets into the choice's text (echo, which would shift them, refuses logprobs).
        offsets = []
        at = 0
        for token in choice.tokens:
            offsets.append(at)
            at += len(token)
        # A stop string cut the text: tokens past the cut are not part of the answer.
        kept = sum(1 for offset in offsets if offset < len(choice.text))
        return {
            "tokens": choice.tokens[first:kept],
            "token_logprobs": choice.token_logprobs[first:kept],
            "top_logprobs": choice.top_logprobs[first:kept] if request.logprobs else None,
            "text_offset": offsets[first:kept],
        }


def _refuse_unsupported(data: dict[str, Any]) -> None:
    if data.get("suffix") is not None:
        raise ApiError(
            400,
            "Unsupported parameter 'suffix': insertion (fill-in-the-middle) is not supported.",
            param="suffix",
            code="unsupported_parameter",
        )


def _samples(data: dict[str, Any], stream: bool) -> tuple[int, int]:
    """(n, best_of): choices per prompt, and candidates to choose them from (OpenAI's rules:
    best_of >= n, and no streaming when candidates are dropped)."""
    n = _get(data, "n", 1)
    if not 1 <= n <= MAX_SAMPLES:
        raise _invalid("n", f"an integer in [1, {MAX_SAMPLES}]", n)
    best_of = _get(data, "best_of", n)
    if not n <= best_of <= MAX_SAMPLES:
        raise _invalid("best_of", f"an integer in [n, {MAX_SAMPLES}] (n = {n})", best_of)
    if stream and best_of > n:
        raise ApiError(
            400,
            "Unsupported parameter 'best_of': best_of > n cannot be streamed (the best are "
            "known only at the end).",
            param="best_of",
            code="unsupported_parameter",
        )
    return n, best_of


def _best(choices: list[_Choice], n: int, best_of: int) -> list[_Choice]:
    """Each prompt's n candidates with the highest cumulative logprob, best first, indexed
    prompt * n + rank (all of them, as they are, when every candidate is a choice)."""
    if best_of == n:
        return choices
    best = []
    for start in range(0, len(choices), best_of):
        candidates = choices[start : start + best_of]
        ranked = sorted(candidates, key=lambda c: c.cumulative_logprob, reverse=True)[:n]
        for rank, choice in enumerate(ranked):
            choice.index = choice.prompt_index * n + rank
            best.append(choice)
    return best


def _envelope(completion_id: str, created: int, model: str) -> dict[str, Any]:
    return {"id": completion_id, "object": "text_completion", "created": created, "model": model}


def _choice_json(
    choice: _Choice, text: str, logprobs: dict | None, prompt_logprobs: list | None = None
) -> dict:
    body = {
        "index": choice.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": choice.finish_reason,
    }
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


def _usage(choices: list[_Choice]) -> dict[str, int]:
    """Each prompt counted once, however many samples read it; every candidate's tokens."""
    prompt = sum(c.prompt_tokens for c in choices if c.candidate == 0)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stop = [value] if isinstance(value, str) else value
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise _invalid("stop", f"a non-empty string or a list of up to {MAX_STOP_STRINGS}", value)
    return stop


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The body's scalar fields and their types, as `_get` reads them; their ranges are checked
# where they are read.
_SCALARS: dict[str, type] = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "echo": bool,
    "stream": bool,
    "n": int,
    "best_of": int,
}
_JSON_TYPES = {int: "integer", float: "number", bool: "boolean"}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_TEXT_OR_IDS = {"anyOf": [{"type": "string"}, _TOKEN_IDS]}


def request_schema() -> dict[str, Any]:
    """The JSON Schema of the bodies `Completions.prepare` reads (the API's description)."""
    properties: dict[str, Any] = {
        "model": {"type": "string"},
        "prompt": {"anyOf": [_TEXT_OR_IDS, {"type": "array", "items": _TEXT_OR_IDS}]},
        **{name: {"type": _JSON_TYPES[kind]} for name, kind in _SCALARS.items()},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
        "stop": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}},
            ]
        },
        "stream_options": {
            "type": "object",
            "properties": {"include_usage": {"type": "boolean"}},
        },
    }
    properties["n"] |= {"minimum": 1, "maximum": MAX_SAMPLES}
    properties["best_of"] |= {"minimum": 1, "maximum": MAX_SAMPLES}
    return {
        "title": "CompletionRequest",
        "type": "object",
        "properties": properties,
        "required": ["model", "prompt"],
    }


def _get(data: dict[str, Any], name: str, default: Any) -> Any:
    kind = _SCALARS[name]
    value = data.get(name)
    if value is None:
        return default
    if kind is float and _is_int(value):
        return float(value)
    if kind is int and not _is_int(value) or not isinstance(value, kind):
        raise _invalid(name, f"of type {kind.__name__}", value)
    return value


def _invalid(name: str, expected: str, got: Any) -> ApiError:
    return ApiError(400, f"Invalid '{name}': must be {expected}, got {got!r}.", param=name)
