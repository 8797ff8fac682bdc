"""The sampling fields the recipe does not carry, read from the request body beside it.

The recipe's conversion stays the DeepSeek contract (it ignores fields the reference
ignores); these fields are vLLM's and OpenAI's extras, carried to the engine or refused
with a 400 that names the field. docs/serve.md has the table per dialect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepwell.serve.errors import ApiError

# OpenAI's bounds (platform.openai.com, Chat Completions): ±2 penalties, ±100 bias.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# Seeds replay through Chat's `seed`, which the recipe bounds to [0, 2**63).
SEED_LIMIT = 2**63

# The dialects whose bodies this reads.
CHAT, RESPONSES, MESSAGES, COMPLETIONS = "chat", "responses", "messages", "completions"

# Fields a dialect has no use for, refused by name rather than silently dropped, with what
# to send instead. Chat's `n` and logprobs are the recipe's (it refuses n != 1 itself).
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


@dataclass(frozen=True)
class SamplingFields:
    """The extra sampling settings of one request; defaults change nothing."""

    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id → additive bias.
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    # A body `seed` where the recipe does not read one (Responses, Messages, completions).
    seed: int | None = None
    # Chat's newer name for the output budget; wins over `max_tokens` (as vLLM reads it).
    max_completion_tokens: int | None = None


def read_sampling_fields(dialect: str, body: Any) -> SamplingFields:
    """The extra fields of a request body; raises ApiError(400) naming a bad or refused one.

    A body in the array form (serde's positional struct) holds only the reference's fields.
    """
    if not isinstance(body, dict):
        return SamplingFields()
    for name, hint in _REFUSED[dialect].items():
        if body.get(name) is not None:
            raise _refused(name, f"it is not a field of this API; {hint}")
    if dialect != CHAT:
        n = body.get("n")
        if n is not None and n != 1:
            raise _refused("n", "only n = 1 is supported; send the request several times")
    top_k = _integer(body, "top_k", -1)
    if top_k < -1:
        raise _invalid("top_k", "-1 or 0 (off) or a positive integer", top_k)
    min_p = _number(body, "min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise _invalid("min_p", "in [0, 1]", min_p)
    repetition = _number(body, "repetition_penalty", 1.0)
    if repetition <= 0:
        raise _invalid("repetition_penalty", "> 0", repetition)
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        penalties[name] = _number(body, name, 0.0)
        if not -MAX_PENALTY <= penalties[name] <= MAX_PENALTY:
            raise _invalid(name, "in [-2, 2]", penalties[name])
    min_tokens = _integer(body, "min_tokens", 0)
    if min_tokens < 0:
        raise _invalid("min_tokens", ">= 0", min_tokens)
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise _invalid("ignore_eos", "a boolean", ignore_eos)
    seed = None if dialect == CHAT else _optional_integer(body, "seed")
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise _invalid("seed", "an integer in [0, 2^63)", seed)
    budget = _optional_integer(body, "max_completion_tokens") if dialect == CHAT else None
    if budget is not None and budget < 1:
        raise _invalid("max_completion_tokens", ">= 1", budget)
    return SamplingFields(
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition,
        logit_bias=_logit_bias(body.get("logit_bias")),
        stop_token_ids=_token_ids(body.get("stop_token_ids")),
        min_tokens=min_tokens,
        ignore_eos=bool(ignore_eos),
        seed=seed,
        max_completion_tokens=budget,
        **penalties,
    )


def check_min_tokens(fields: SamplingFields, max_tokens: int) -> None:
    """`min_tokens` may not exceed the request's resolved output budget."""
    if fields.min_tokens > max_tokens:
        raise _invalid("min_tokens", f"at most the output budget ({max_tokens})", fields.min_tokens)


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _invalid("logit_bias", "an object of token id → bias", value)
    bias = {}
    for key, amount in value.items():
        # JSON object keys are strings: OpenAI sends {"50256": -100}.
        if not (isinstance(key, str) and key.isdigit()):
            raise _invalid("logit_bias", "keyed by token ids", key)
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            raise _invalid("logit_bias", "numbers", amount)
        if not -MAX_LOGIT_BIAS <= amount <= MAX_LOGIT_BIAS:
            raise _invalid(f"logit_bias[{key}]", "in [-100, 100]", amount)
        bias[int(key)] = float(amount)
    return bias


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
        raise _invalid("stop_token_ids", "a list of token ids", value)
    return tuple(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and not _is_int(value):
        raise _invalid(name, "an integer", value)
    return value


def _integer(body: dict[str, Any], name: str, default: int) -> int:
    value = _optional_integer(body, name)
    return default if value is None else value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(name, "a number", value)
    return float(value)


def _invalid(name: str, expected: str, got: Any) -> ApiError:
    return ApiError(400, f"Invalid '{name}': must be {expected}, got {got!r}.", param=name)


def _refused(name: str, why: str) -> ApiError:
    return ApiError(
        400, f"Unsupported parameter '{name}': {why}.", param=name, code="unsupported_parameter"
    )
