"""The engine's default settings, read by `EngineArgs`, the command line and serve's worker.

Free of torch imports (beside `engine_options.py`, not inside `deepwell.engine`, whose
package imports torch), so the HTTP process reads them without loading the engine.
"""

# What each one means: the `EngineArgs` field of the same name (engine/args.py).
# They follow DeepInfer where it has one (128-token blocks, spec/deepinfer.md §1.3).
DTYPES = ("bfloat16", "float32")
DTYPE = "bfloat16"
QUANTIZATIONS = ("none", "int4")
QUANTIZATION = "none"
BLOCK_SIZE = 128
MEMORY_GIB = 4.0
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 1024
SEED = 0
ENABLE_PREFIX_CACHING = True
KV_STORE_CAPACITY_GIB = 100.0
KV_STORE_TTL_CHAT_S = 7 * 86400.0
KV_STORE_TTL_AGENT_S = 3 * 86400.0
GRAMMAR_COMPILE_TIMEOUT_S = 10.0
NUM_SPECULATIVE_TOKENS = 5
ASYNC_SCHEDULING = True
QUANTIZE_KV_CACHE = True
