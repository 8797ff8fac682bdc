"""The engine's default settings, read by `EngineArgs`, the command line and serve's worker.

Free of torch imports (beside `engine_options.py`, not inside `deepwell.engine`, whose
package imports torch), so the HTTP process reads them without loading the engine.
"""

import os


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


# What each one means: the `EngineArgs` field of the same name (engine/args.py).
# They follow DeepInfer where it has one (128-token blocks, spec/deepinfer.md §1.3).
# "auto": bf16 where the CPU computes it natively, else float32 (deepwell/cpu_dtype.py).
DTYPES = ("auto", "bfloat16", "float32")
DTYPE = "auto"
QUANTIZATIONS = ("none", "int4")
QUANTIZATION = "none"
# Decode attention: "cpp" is the fused C++ kernel (layers/cpp_paged.py, built once per
# machine), "torch" the pure-torch path, "auto" the kernel where it builds, else torch;
# DEEPWELL_ATTENTION_BACKEND overrides the default (EngineArgs).
ATTENTION_BACKENDS = ("auto", "torch", "cpp")
ATTENTION_BACKEND = "auto"
# DEEPWELL_NATIVE_DECODE overrides the default (EngineArgs).
NATIVE_DECODES = ("auto", "off")
NATIVE_DECODE = "auto"
BLOCK_SIZE = 128
MEMORY_GIB = 4.0
# Share of the memory budget kept for activations and the allocator, besides weights and KV
# (kv/cache.py plans the KV blocks with it, engine/plan/ the fit).
ACTIVATION_RESERVE = 0.15
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 1024
SEED = 0
ENABLE_PREFIX_CACHING = True
KV_STORE_CAPACITY_GIB = 100.0
KV_STORE_TTL_CHAT_S = 7 * 86400.0
KV_STORE_TTL_AGENT_S = 3 * 86400.0
GRAMMAR_COMPILE_TIMEOUT_S = 10.0
# DeepInfer's DEEPINFER_USE_NEXTN_DECODE (spec/deepinfer.md §1.4), mirrored.
NUM_SPECULATIVE_TOKENS = _env_int("DEEPWELL_USE_NEXTN_DECODE", 5)
# None: DSpark when the checkpoint has draft stages (`mtp.*`), n-gram lookup otherwise.
SPECULATIVE_METHODS = ("ngram", "dspark")
SPECULATIVE_METHOD = None
ASYNC_SCHEDULING = True
QUANTIZE_KV_CACHE = True
# SWA bounded replay of DeepSeek-V4.1's YOCO consumer layers (DeepInfer's
# DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE / _KEEP_TOKENS, spec/deepinfer.md §1.4, §1.6):
# off is exact; 140 is DeepInfer's README keep (window 128 + backtracking 6, and margin).
YOCO_TRUNCATION_MODES = ("off", "mask", "compact")
YOCO_PREFILL_TRUNCATION_MODE = "off"
YOCO_PREFILL_KEEP_TOKENS = 140
# Mirror context parallelism for long prefills (docs/parallel.md): off.
CONTEXT_PARALLEL_SIZE = 1
# `deepwell bench --sweep`: chosen so that the sweep of the embedded SmolLM2 finishes in a few
# minutes on a shared 2-core machine (docs/benchmarks.md); larger machines pass their own.
SWEEP_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128)
SWEEP_PREFILL_BATCH_TOKENS = (32, 64, 128, 256, 512, 1024, 2048)
