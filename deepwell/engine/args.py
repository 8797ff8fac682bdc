"""EngineArgs: every knob of the engine in one typed place.

Its defaults live in `deepwell.engine_defaults`, which the command line and serve read too.
"""

import os
from dataclasses import dataclass, field

import torch

from deepwell import engine_defaults as defaults
from deepwell.cpu_dtype import AUTO, DtypeChoice, select_dtype
from deepwell.engine.parallel.group import ParallelConfig

DTYPES = {name: getattr(torch, name) for name in defaults.DTYPES if name != AUTO}


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def env_flag(name: str) -> bool:
    """DeepInfer's reading of a boolean switch: set and not "0", "false" or "False"."""
    return os.environ.get(name, "") not in ("", "0", "false", "False")


def env_floats(name: str, default: str) -> tuple[float, ...]:
    """A float or a comma-separated list of floats (DeepInfer's per-position switches)."""
    value = os.environ.get(name, "") or default
    try:
        return tuple(float(part) for part in value.split(","))
    except ValueError:
        raise ValueError(
            f"{name} must be a float or a comma list of floats, got {value!r}"
        ) from None


@dataclass
class EngineArgs:
    # A GGUF file or a directory with config.json + safetensors; None = embedded SmolLM2.
    model: str | None = None
    # "auto" computes in bf16 where the CPU has it natively, else float32 (cpu_dtype.py);
    # fp16 matmuls are unusably slow on CPUs; float32 is for exact comparisons.
    dtype: str = defaults.DTYPE
    # "int4": linear calls of a few rows (decode) use GGUF blocks: Q4_1 layers and a Q8_0
    # output head (layers/quant_linear.py); "none" keeps every linear in the compute dtype.
    quantization: str = defaults.QUANTIZATION
    # Decode attention: "cpp" (the fused C++ kernel, an error where it cannot be built),
    # "torch" or "auto" (the kernel where it builds). Batch-invariant mode runs its own
    # kernels whatever this says. Default: DEEPWELL_ATTENTION_BACKEND, else auto.
    attention_backend: str = field(
        default_factory=lambda: (
            os.environ.get("DEEPWELL_ATTENTION_BACKEND", "") or defaults.ATTENTION_BACKEND
        )
    )
    # Llama-family decode steps of a few rows through every layer in one C++ call
    # (models/llama_native.py): "auto" where the model runs int4 linears and the C++
    # attention, "off" never. Default: DEEPWELL_NATIVE_DECODE, else auto.
    native_decode: str = field(
        default_factory=lambda: (
            os.environ.get("DEEPWELL_NATIVE_DECODE", "") or defaults.NATIVE_DECODE
        )
    )
    block_size: int = defaults.BLOCK_SIZE
    # Weights plus KV cache must fit in this many GiB.
    memory_gib: float = defaults.MEMORY_GIB
    # Fix the number of KV blocks instead of deriving it from memory_gib (tests, tuning).
    num_kv_blocks: int | None = None
    # None = the model's own context length.
    max_model_len: int | None = None
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    # Token budget of one step: prefill chunks and decodes together.
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    seed: int = defaults.SEED
    # None = every core torch sees.
    num_threads: int | None = None
    # Reuse cached KV blocks across requests with a common prefix.
    enable_prefix_caching: bool = defaults.ENABLE_PREFIX_CACHING
    # A directory of KV block files shared by workers (3FS, NFS); None = memory only.
    kv_store_path: str | None = None
    kv_store_capacity_gib: float = defaults.KV_STORE_CAPACITY_GIB
    # How long a stored block outlives its last write or hit, per traffic class.
    kv_store_ttl_chat_s: float = defaults.KV_STORE_TTL_CHAT_S
    kv_store_ttl_agent_s: float = defaults.KV_STORE_TTL_AGENT_S
    # A request whose grammar takes longer to compile fails (HTTP 400), not the engine.
    grammar_compile_timeout_s: float = defaults.GRAMMAR_COMPILE_TIMEOUT_S
    # A request's logits are bitwise the same whatever its batch, neighbours and prefill
    # chunking (layers/batch_invariant.py); costs throughput. Default: DEEPWELL_BATCH_INVARIANT.
    batch_invariant: bool = field(default_factory=lambda: env_flag("DEEPWELL_BATCH_INVARIANT"))
    # Draft tokens per request and step, verified losslessly; 0 turns speculative decoding
    # off. Default: DEEPWELL_USE_NEXTN_DECODE, else 5.
    num_speculative_tokens: int = defaults.NUM_SPECULATIVE_TOKENS
    # "ngram" (prompt lookup) or "dspark" (DeepSeek-V4.1's draft stages); None picks dspark
    # when the checkpoint has them.
    speculative_method: str | None = defaults.SPECULATIVE_METHOD
    # Temperature of DSpark's confidence head, one for all positions or one per position
    # (DeepInfer's DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE, spec/deepinfer.md §1.4).
    dspark_confidence_temperature: tuple[float, ...] = field(
        default_factory=lambda: env_floats("DEEPWELL_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "1.0")
    )
    # Schedule step N+1 and hand back step N's tokens while step N+1 computes (core.py);
    # outputs are the same either way.
    async_scheduling: bool = defaults.ASYNC_SCHEDULING
    # DeepSeek-V4.1 keeps its caches in the quantised formats it was trained with (fp8
    # window KV, fp4 compressed KV and index keys, spec/deepseek_v41.md §3.7); off computes
    # them in the engine dtype, for exact comparisons against a reference without them.
    quantize_kv_cache: bool = defaults.QUANTIZE_KV_CACHE
    # DeepSeek-V4.1: dequantise every weight to the compute dtype as it loads and run plain
    # linears and per-expert loops (the reference for tokens and the baseline for speed);
    # off keeps the released FP8/MXFP4 encodings. Default: DEEPWELL_EXPAND_WEIGHTS.
    expand_weights: bool = field(default_factory=lambda: env_flag("DEEPWELL_EXPAND_WEIGHTS"))
    # DeepSeek-V4.1 SWA bounded replay (kv/replay.py): "off" runs every layer over every
    # position (exact); "mask" and "compact" let the YOCO consumer layers see only the last
    # `yoco_prefill_keep_tokens` prompt positions through their window ("compact" also skips
    # their rows before that). Defaults: DEEPWELL_YOCO_PREFILL_TRUNCATION_MODE and
    # DEEPWELL_YOCO_PREFILL_KEEP_TOKENS, DeepInfer's DEEPINFER_YOCO_PREFILL_* switches.
    yoco_prefill_truncation_mode: str = field(
        default_factory=lambda: os.environ.get(
            "DEEPWELL_YOCO_PREFILL_TRUNCATION_MODE", defaults.YOCO_PREFILL_TRUNCATION_MODE
        )
    )
    yoco_prefill_keep_tokens: int = field(
        default_factory=lambda: env_int(
            "DEEPWELL_YOCO_PREFILL_KEEP_TOKENS", defaults.YOCO_PREFILL_KEEP_TOKENS
        )
    )
    # Attention data parallelism, MoE expert parallelism and EPLB over torch.distributed
    # (parallel/); one rank per EngineCore.
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Mirror context parallelism (parallel/context.py): ranks on this machine that share a
    # long prefill; 1 runs every step on this process alone.
    context_parallel_size: int = defaults.CONTEXT_PARALLEL_SIZE
    # A prefill chunk of at least this many tokens runs across the ranks; shorter ones run
    # on rank 0. None: twice the model's sliding window.
    context_parallel_min_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in defaults.DTYPES:
            raise ValueError(f"dtype must be one of {list(defaults.DTYPES)}, got {self.dtype!r}")
        if self.quantization not in defaults.QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {list(defaults.QUANTIZATIONS)}, "
                f"got {self.quantization!r}"
            )
        if self.attention_backend not in defaults.ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {list(defaults.ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.native_decode not in defaults.NATIVE_DECODES:
            raise ValueError(
                f"native_decode must be one of {list(defaults.NATIVE_DECODES)}, "
                f"got {self.native_decode!r}"
            )
        if self.quantization == "int4" and self.batch_invariant:
            # A row's bits would change with the call's row count (4-bit blocks below a
            # few rows, the dense weights above).
            raise ValueError("int4 quantization cannot run batch-invariant")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.memory_gib <= 0:
            raise ValueError(f"memory_gib must be positive, got {self.memory_gib}")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError(
                f"grammar_compile_timeout_s must be positive, got {self.grammar_compile_timeout_s}"
            )
        for name in ("kv_store_capacity_gib", "kv_store_ttl_chat_s", "kv_store_ttl_agent_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_store_path is not None and not self.enable_prefix_caching:
            raise ValueError("kv_store_path needs enable_prefix_caching")
        if self.num_speculative_tokens < 0:
            raise ValueError(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}"
            )
        if self.yoco_prefill_truncation_mode not in defaults.YOCO_TRUNCATION_MODES:
            raise ValueError(
                "yoco_prefill_truncation_mode must be one of "
                f"{defaults.YOCO_TRUNCATION_MODES}, got {self.yoco_prefill_truncation_mode!r}"
            )
        if self.yoco_prefill_keep_tokens <= 0:
            raise ValueError(
                f"yoco_prefill_keep_tokens must be positive, got {self.yoco_prefill_keep_tokens}"
            )
        if self.batch_invariant and self.yoco_prefill_truncation_mode == "compact":
            # Its consumer layers run only some of a step's rows, which the row tiles of
            # batch-invariant mode do not cover; mask mode computes the same function.
            raise ValueError(
                "batch_invariant does not combine with yoco_prefill_truncation_mode "
                "'compact'; use 'mask', which gives the same tokens"
            )
        if self.speculative_method not in (None, *defaults.SPECULATIVE_METHODS):
            raise ValueError(
                f"speculative_method must be one of {defaults.SPECULATIVE_METHODS}, "
                f"got {self.speculative_method!r}"
            )
        if not self.dspark_confidence_temperature or any(
            t <= 0 for t in self.dspark_confidence_temperature
        ):
            raise ValueError(
                "dspark_confidence_temperature must be positive, got "
                f"{self.dspark_confidence_temperature}"
            )
        if self.parallel.expert_parallel:
            # The ranks' steps meet in every MoE layer's all-to-all, so every rank runs every
            # MoE layer once per step: no separate drafter forward, no early exit.
            if self.speculative_method == "dspark":
                raise ValueError(
                    "DSpark drafting runs its own MoE stages outside the ranks' lock step; "
                    "with expert parallelism use --speculative-method ngram"
                )
            if self.yoco_prefill_truncation_mode == "compact":
                raise ValueError(
                    "compact bounded replay can skip a step's last layers, which expert-parallel "
                    "ranks must all run; use yoco_prefill_truncation_mode 'mask'"
                )
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        self._check_context_parallel()

    def _check_context_parallel(self) -> None:
        if self.context_parallel_size < 1:
            raise ValueError(
                f"context_parallel_size must be >= 1, got {self.context_parallel_size}"
            )
        if self.context_parallel_min_tokens is not None and self.context_parallel_min_tokens < 1:
            raise ValueError(
                "context_parallel_min_tokens must be positive, got "
                f"{self.context_parallel_min_tokens}"
            )
        if self.context_parallel_size == 1:
            return
        # CP spawns its own group from rank 0; it does not yet nest inside a DP/EP group.
        if self.parallel.data_parallel_size > 1 or self.parallel.expert_parallel:
            raise ValueError(
                "context parallelism does not combine with data or expert parallelism yet; "
                "use --context-parallel-size alone, or --data-parallel-size/--expert-parallel "
                "alone (docs/parallel.md)"
            )
        # The parallel prefill runs every layer over every position (docs/parallel.md).
        if self.yoco_prefill_truncation_mode != "off":
            raise ValueError(
                "context parallelism needs yoco_prefill_truncation_mode 'off', got "
                f"{self.yoco_prefill_truncation_mode!r}"
            )

    @property
    def dtype_choice(self) -> DtypeChoice:
        """What `dtype` resolves to on this machine, and why (a property, not a field, so
        `vars(args)` stays the constructor's keywords)."""
        return select_dtype(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_choice.dtype]
