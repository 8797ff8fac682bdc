"""EngineArgs: every knob of the engine in one typed place.

Its defaults live in `deepwell.engine_defaults`, which the command line and serve read too.
"""

import os
from dataclasses import dataclass, field

import torch

from deepwell import engine_defaults as defaults

DTYPES = {name: getattr(torch, name) for name in defaults.DTYPES}


def env_flag(name: str) -> bool:
    """DeepInfer's reading of a boolean switch: set and not "0", "false" or "False"."""
    return os.environ.get(name, "") not in ("", "0", "false", "False")


@dataclass
class EngineArgs:
    # A GGUF file or a directory with config.json + safetensors; None = embedded SmolLM2.
    model: str | None = None
    # bf16 is the CPU compute dtype (fp16 matmuls are unusably slow on CPUs);
    # float32 is for exact comparisons against a reference.
    dtype: str = defaults.DTYPE
    # "int4": linear calls of a few rows (decode) use 4-bit weights in groups of 32 (bf16
    # only, layers/int4_linear.py); "none" keeps every linear in the compute dtype.
    quantization: str = defaults.QUANTIZATION
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
    # Draft tokens per request and step (n-gram lookup, verified losslessly); 0 turns
    # speculative decoding off.
    num_speculative_tokens: int = defaults.NUM_SPECULATIVE_TOKENS
    # Schedule step N+1 and hand back step N's tokens while step N+1 computes (core.py);
    # outputs are the same either way.
    async_scheduling: bool = defaults.ASYNC_SCHEDULING
    # DeepSeek-V4.1 keeps its caches in the quantised formats it was trained with (fp8
    # window KV, fp4 compressed KV and index keys, spec/deepseek_v41.md §3.7); off computes
    # them in the engine dtype, for exact comparisons against a reference without them.
    quantize_kv_cache: bool = defaults.QUANTIZE_KV_CACHE

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in defaults.QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {list(defaults.QUANTIZATIONS)}, "
                f"got {self.quantization!r}"
            )
        if self.quantization == "int4" and (self.dtype == "float32" or self.batch_invariant):
            # Its kernel takes bf16 activations, and a row's bits would change with the
            # call's row count (int4 below a few rows, bf16 above).
            raise ValueError("int4 quantization needs dtype bfloat16 and no batch invariance")
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
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
