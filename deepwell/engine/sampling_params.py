"""SamplingParams: how one request turns logits into tokens, validated on construction.

Field names follow vLLM / DeepInfer (spec/deepinfer.md §1.5) where they overlap. Torch-free:
the HTTP process builds it from a request body and sends it to a worker as it is.
"""

from dataclasses import dataclass, field

from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.structured.spec import StructuredOutput

MAX_TOP_LOGPROBS = 20
# OpenAI's bounds (platform.openai.com, Chat Completions): a logit_bias value of ±100
# bans or forces a token; presence and frequency penalties are within ±2.
MAX_LOGIT_BIAS = 100
MAX_PENALTY = 2


@dataclass
class SamplingParams:
    max_tokens: int = 16
    # 0 means greedy (argmax); the filters below then have no effect.
    temperature: float = 1.0
    top_p: float = 1.0
    # -1 (or 0) disables top-k.
    top_k: int = -1
    min_p: float = 0.0
    # HF-style multiplicative penalty over prompt and output tokens.
    repetition_penalty: float = 1.0
    # OpenAI-style additive penalties over output tokens only.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Stop ids (and EOS, unless ignore_eos) are masked until this many tokens are out.
    min_tokens: int = 0
    # OpenAI-style additive bias per token id, in [-100, 100], added before any filter.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Per-request 64-bit seed (other ints are masked to 64 bits, as DeepInfer does): the
    # request's samples depend only on it and the sampled positions. None = a random seed.
    seed: int | None = None
    # Return the sampled token's log-probability, plus this many top alternatives.
    logprobs: bool = False
    top_logprobs: int = 0
    # Constrain the output to a JSON schema, regex or grammar (DeepInfer's `so_args`).
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter: {message}", param)

        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise bad(
                "max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}"
            )
        if self.temperature < 0:
            raise bad("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad(
                "top_k", f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}"
            )
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise bad(name, f"{name} must be in [-2, 2], got {value}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad(
                "stop_token_ids",
                f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}",
            )
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(
                "min_tokens",
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
            )
        for token_id, bias in self.logit_bias.items():
            if not isinstance(token_id, int) or token_id < 0:
                raise bad("logit_bias", f"logit_bias keys must be token ids, got {token_id!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise bad(
                    f"logit_bias[{token_id}]",
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
                    f"got {bias} for token {token_id}",
                )
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad(
                "top_logprobs",
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
            )
        if self.top_logprobs and not self.logprobs:
            raise bad("top_logprobs", "top_logprobs needs logprobs=True")
        if self.seed is not None:
            if not isinstance(self.seed, int):
                raise bad("seed", f"seed must be an integer, got {self.seed!r}")
            self.seed &= (1 << 64) - 1
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutput
        ):
            raise bad("structured_output", "structured_output must be a StructuredOutput")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling edits this request's logits from its own state (penalties,
        bias, a minimum length), beyond the stateless filters."""
        return self.penalised or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def penalised(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
