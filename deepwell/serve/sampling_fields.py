"""The one reader of a request's sampling: the recipe's options plus the body's extra fields,
made into the engine's SamplingParams, which travels to the worker as it is.

The recipe's conversion stays the DeepSeek contract (it ignores fields the reference
ignores); the extra fields are vLLM's and OpenAI's, read here for their JSON types and
checked for their ranges by SamplingParams itself, or refused with a 400 that names the
field. docs/serve.md has the table per dialect.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.structured.spec import StructuredOutput
from deepwell.recipe import InferenceOptions
from deepwell.serve.errors import ApiError

# Seeds replay through Chat's `seed`, which the recipe bounds to [0, 2**63).
SEED_LIMIT = 2**63

# The dialects whose bodies this reads.
CHAT, RESPONSES, MESSAGES, COMPLETIONS = "chat", "responses", "messages", "completions"

# Fields a dialect has no use for, refused by name rather than silently dropped, with what
# to send instead. Chat's `n` and logprobs are the recipe's (it refuses n != 1 itself);
# /v1/completions reads its own `n` (completions.py).
_REFUSED: dict[str, dict[str, str]] = {
    CHAT: {},
    RESPONSES: {
        "max_tokens": "use `max_output_tokens`",
        "max_completion_tokens": "use `max_output_tokens`",
        "logprobs": "use `top_logprobs`",
    },
    MESSAGES: {
        "max_completion_tokens": "use `max_tokens`",
        "logprobs": "Anthropic Messages has no log-probabilities; use /v1/chat/completions",
        "top_logprobs": "Anthropic Messages has no log-probabilities; use /v1/chat/completions",
    },
    COMPLETIONS: {},
}


def requested_budget(dialect: str, body: Any) -> int | None:
    """Chat's `max_completion_tokens`, its newer name for the output budget, which wins over
    `max_tokens` (as vLLM reads it); None when absent or not Chat."""
    if dialect != CHAT or not isinstance(body, dict):
        return None
    budget = _optional_integer(body, "max_completion_tokens")
    if budget is not None and budget < 1:
        raise _invalid("max_completion_tokens", ">= 1", budget)
    return budget


def read_sampling_params(
    dialect: str,
    body: Any,
    options: InferenceOptions,
    *,
    max_tokens: int,
    fallback_seed: int,
    model_stop_token_ids: Iterable[int],
    structured_output: StructuredOutput | None = None,
) -> SamplingParams:
    """The request's SamplingParams; raises ApiError(400) naming a bad or refused field.

    `options` holds what the recipe read (temperature, top_p, logprobs, Chat's seed);
    `max_tokens` is the resolved output budget; the request samples with `fallback_seed`
    when neither the recipe nor the body gives a seed. The model's stop ids end the
    request unless the body sets `ignore_eos`. A body in the array form (serde's
    positional struct) holds only the reference's fields.
    """
    fields = _extra_fields(dialect, body) if isinstance(body, dict) else {}
    body_seed = fields.pop("seed", None)
    seed = next((s for s in (options.seed, body_seed) if s is not None), None)
    if seed is None and fields.get("seq_seed") is None:
        seed = fallback_seed
    if fields.get("so_args") is not None and structured_output is not None:
        raise _refused(
            "so_args", "the request constrains its output already (response_format or tools)"
        )
    model_stop = [] if fields.get("ignore_eos") else model_stop_token_ids
    stop = sorted({*model_stop, *fields.pop("stop_token_ids", ())})
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if options.temperature is None else options.temperature,
            top_p=1.0 if options.top_p is None else options.top_p,
            logprobs=options.logprobs,
            top_logprobs=(options.top_logprobs or 0) if options.logprobs else 0,
            seed=seed,
            stop_token_ids=stop,
            structured_output=structured_output,
            **fields,
        )
    except InvalidRequestError as error:
        raise ApiError(400, str(error), param=error.param) from None


def _extra_fields(dialect: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body's extra fields that are set, as SamplingParams keywords of the right JSON
    type (plus `seed` where the recipe does not read one); their ranges are SamplingParams'."""
    for name, hint in _REFUSED[dialect].items():
        if body.get(name) is not None:
            raise _refused(name, f"it is not a field of this API; {hint}")
    if dialect in (RESPONSES, MESSAGES):
        n = body.get("n")
        if n is not None and n != 1:
            raise _refused("n", "only n = 1 is supported; send the request several times")
    fields: dict[str, Any] = {
        "top_k": _optional_integer(body, "top_k"),
        "min_tokens": _optional_integer(body, "min_tokens"),
        "logit_bias": _logit_bias(body.get("logit_bias")),
        "stop_token_ids": _token_ids(body.get("stop_token_ids"), "stop_token_ids"),
    }
    for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        fields[name] = _number(body, name)
    fields |= _deepinfer_fields(dialect, body)
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise _invalid("ignore_eos", "a boolean", ignore_eos)
    fields["ignore_eos"] = ignore_eos
    if dialect != CHAT:
        seed = _optional_integer(body, "seed")
        if seed is not None and not 0 <= seed < SEED_LIMIT:
            raise _invalid("seed", "an integer in [0, 2^63)", seed)
        fields["seed"] = seed
    return {name: value for name, value in fields.items() if value is not None}


def _deepinfer_fields(dialect: str, body: dict[str, Any]) -> dict[str, Any]:
    """DeepInfer's SamplingParams fields (spec/deepinfer.md §1.5) the dialects have no field
    for, sent in `extra_body`; `prompt_logprobs` in /v1/completions only (vLLM's place)."""
    seq_seed = _optional_integer(body, "seq_seed")
    if seq_seed is not None and not 0 <= seq_seed < 2**64:
        raise _invalid("seq_seed", "an integer in [0, 2^64)", seq_seed)
    so_args = body.get("so_args")
    if so_args is not None and not isinstance(so_args, dict):
        raise _invalid("so_args", "an object (schema_type, schema, ...)", so_args)
    fields = {
        "seq_seed": seq_seed,
        "so_args": so_args,
        "first_n_token_no_eos": _optional_integer(body, "first_n_token_no_eos"),
        "eos_id": _optional_integer(body, "eos_id"),
        "golden_token_ids": _token_ids(body.get("golden_token_ids"), "golden_token_ids"),
    }
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None:
        if dialect != COMPLETIONS:
            raise _refused("prompt_logprobs", "it is a field of /v1/completions only")
        if not isinstance(prompt_logprobs, int):
            raise _invalid("prompt_logprobs", "a boolean or an integer", prompt_logprobs)
        fields["prompt_logprobs"] = prompt_logprobs
    return fields


def _logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _invalid("logit_bias", "an object of token id → bias", value)
    bias = {}
    for key, amount in value.items():
        # JSON object keys are strings: OpenAI sends {"50256": -100}.
        if not (isinstance(key, str) and key.isdigit()):
            raise _invalid("logit_bias", "keyed by token ids", key)
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            raise _invalid("logit_bias", "numbers", amount)
        bias[int(key)] = float(amount)
    return bias


def _token_ids(value: Any, name: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise _invalid(name, "a list of token ids", value)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and not _is_int(value):
        raise _invalid(name, "an integer", value)
    return value


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(name, "a number", value)
    return float(value)


def _invalid(name: str, expected: str, got: Any) -> ApiError:
    return ApiError(400, f"Invalid '{name}': must be {expected}, got {got!r}.", param=name)


def _refused(name: str, why: str) -> ApiError:
    return ApiError(
        400, f"Unsupported parameter '{name}': {why}.", param=name, code="unsupported_parameter"
    )
