"""SamplingParams: how one request turns logits into tokens, validated on construction.

Field names follow vLLM, and DeepInfer's fields keep its names and meanings (spec/deepinfer.md
§1.5), so a DeepInfer script's SamplingParams work unchanged. Torch-free: the HTTP process
builds it from a request body and sends it to a worker as it is.
"""

from dataclasses import dataclass, field

from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.structured.so_args import structured_output_from_so_args
from deepwell.engine.structured.spec import StructuredOutput

# DeepInfer's bound (spec/deepinfer.md §1.5); the HTTP dialects keep their own, lower ones.
MAX_TOP_LOGPROBS = 1000
# DeepInfer clamps a temperature below this to it, with top-p and top-k off (§1.5).
MIN_TEMPERATURE = 1e-5
_MAX_INT32 = 2**31 - 1
# OpenAI's bounds (platform.openai.com, Chat Completions): a logit_bias value of ±100
# bans or forces a token; presence and frequency penalties are within ±2.
MAX_LOGIT_BIAS = 100
MAX_PENALTY = 2


@dataclass
class SamplingParams:
    # 0 is taken as 1 (DeepInfer's rule).
    max_tokens: int = 16
    # 0 means greedy (argmax, the first of tied maxima); the filters below then have no
    # effect. Above 0 and below 1e-5 it is clamped to 1e-5 with top_p 1 and top_k -1, as
    # DeepInfer clamps every temperature below 1e-5 (there 0 samples at 1e-5 too, which
    # picks the argmax unless logits tie within ~1e-4).
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
    # Return the sampled token's log-probability, plus this many top alternatives (up to
    # 1000, as DeepInfer; a positive count turns logprobs on).
    logprobs: bool = False
    top_logprobs: int = 0
    # Constrain the output to a JSON schema, regex or grammar.
    structured_output: StructuredOutput | None = None
    # A constrained request resumed on another worker (serve's failover): the output it had
    # already produced, now the end of its prompt. The grammar consumes these first, so the
    # rest of the output is constrained from where the lost worker stopped.
    grammar_replay_token_ids: tuple[int, ...] = ()
    # DeepInfer's fields (spec/deepinfer.md §1.5). `seq_seed` is `seed` under DeepInfer's
    # name: set either (or both, equal); afterwards both hold the masked value.
    seq_seed: int | None = None
    # DeepInfer's constraint dict (schema_type json/regex/ebnf, schema, trigger_token_ids,
    # bound_token_id), read into `structured_output` on construction and then cleared.
    so_args: dict | None = None
    # The log-probability of every prompt token after the first. True (DeepInfer's): with
    # top_logprobs alternatives; an int N (vLLM's /v1/completions): with N, 0 for none;
    # False or None: off. The prompt is then computed whole, not taken from the prefix cache.
    prompt_logprobs: bool | int | None = False
    # `eos_id` cannot be sampled as one of the first this-many output tokens.
    first_n_token_no_eos: int = 0
    eos_id: int = 0
    # Teacher forcing: the first output tokens are these, whatever the model samples (their
    # logprobs are the model's); sampling goes on after them.
    golden_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter: {message}", param)

        if not isinstance(self.max_tokens, int) or not 0 <= self.max_tokens <= _MAX_INT32:
            raise bad(
                "max_tokens",
                f"max_tokens must be an integer in [0, 2^31), got {self.max_tokens!r}",
            )
        self.max_tokens = max(self.max_tokens, 1)
        if self.temperature < 0:
            raise bad("temperature", f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature, self.top_p, self.top_k = MIN_TEMPERATURE, 1.0, -1
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
        self._read_deepinfer_fields(bad)
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad(
                "top_logprobs",
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
            )
        if self.top_logprobs:
            self.logprobs = True
        if self.seed is not None:
            if not isinstance(self.seed, int):
                raise bad("seed", f"seed must be an integer, got {self.seed!r}")
            self.seed &= (1 << 64) - 1
        self.seq_seed = self.seed
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutput
        ):
            raise bad("structured_output", "structured_output must be a StructuredOutput")
        # A tuple again after a process hop (msgpack gives lists).
        self.grammar_replay_token_ids = tuple(self.grammar_replay_token_ids)
        if self.grammar_replay_token_ids and self.structured_output is None:
            raise bad(
                "grammar_replay_token_ids",
                "grammar_replay_token_ids resume a constraint; set structured_output too",
            )

    def _read_deepinfer_fields(self, bad) -> None:
        """Check DeepInfer's fields and fold `seq_seed` and `so_args` into deepwell's."""
        if self.seq_seed is not None:
            if not isinstance(self.seq_seed, int):
                raise bad("seq_seed", f"seq_seed must be an integer, got {self.seq_seed!r}")
            mask = (1 << 64) - 1
            if self.seed is not None and (self.seed & mask) != (self.seq_seed & mask):
                raise bad(
                    "seq_seed",
                    f"seq_seed {self.seq_seed} and seed {self.seed} differ; they are one "
                    "setting, set one of them",
                )
            self.seed = self.seq_seed
        if self.so_args is not None:
            if self.structured_output is not None:
                raise bad("so_args", "so_args and structured_output are one setting; set one")
            self.structured_output = structured_output_from_so_args(self.so_args)
            self.so_args = None
        prompt = self.prompt_logprobs
        if not (
            prompt is None
            or isinstance(prompt, bool)
            or (isinstance(prompt, int) and 0 <= prompt <= MAX_TOP_LOGPROBS)
        ):
            raise bad(
                "prompt_logprobs",
                f"prompt_logprobs must be a boolean or a count in [0, {MAX_TOP_LOGPROBS}], "
                f"got {prompt!r}",
            )
        for name in ("first_n_token_no_eos", "eos_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(name, f"{name} must be a non-negative integer, got {value!r}")
        golden = self.golden_token_ids
        if golden is not None:
            if not isinstance(golden, list | tuple) or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in golden
            ):
                raise bad(
                    "golden_token_ids",
                    f"golden_token_ids must be a list of token ids, got {golden!r}",
                )
            self.golden_token_ids = list(golden)

    @property
    def wants_prompt_logprobs(self) -> bool:
        prompt = self.prompt_logprobs
        return prompt is True or (prompt is not None and not isinstance(prompt, bool))

    @property
    def prompt_top_logprobs(self) -> int:
        """Alternatives per prompt token: top_logprobs for True, else the count asked for."""
        if isinstance(self.prompt_logprobs, bool):
            return self.top_logprobs
        return self.prompt_logprobs

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling edits this request's logits from its own state (penalties,
        bias, a minimum length), beyond the stateless filters."""
        return (
            self.penalised
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.first_n_token_no_eos > 0
        )

    @property
    def penalised(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
