"""The command-line options that set the engine, shared by `generate`, `bench` and `serve`.

Free of torch imports, so the HTTP process can build its parser without loading the engine.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from deepwell import engine_defaults as defaults


@dataclass(frozen=True)
class EngineGroups:
    """The `--help` sections the engine options go in; commands add their own to them."""

    model: argparse._ArgumentGroup
    engine: argparse._ArgumentGroup
    cache: argparse._ArgumentGroup


def add_engine_arguments(parser: argparse.ArgumentParser) -> EngineGroups:
    """Model, dtype, KV cache, batch invariance, speculation, step overlap and threads: the
    options every engine user has, in three `--help` groups."""
    groups = EngineGroups(
        model=parser.add_argument_group("model"),
        engine=parser.add_argument_group("engine"),
        cache=parser.add_argument_group("KV cache"),
    )
    model, engine, cache = groups.model, groups.engine, groups.cache
    model.add_argument(
        "--model",
        metavar="PATH",
        help="a .gguf file or a directory with config.json + safetensors "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    model.add_argument(
        "--dtype",
        choices=defaults.DTYPES,
        default=defaults.DTYPE,
        help="compute dtype; auto = bfloat16 where the CPU computes it natively "
        "(AVX512_BF16, AMX-BF16, Arm BF16), float32 elsewhere (default: auto; float32 for "
        "exact comparisons)",
    )
    engine.add_argument(
        "--memory-gib",
        type=float,
        default=defaults.MEMORY_GIB,
        help=f"memory budget for weights plus KV cache, in GiB (default: {defaults.MEMORY_GIB:g})",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults.MAX_NUM_BATCHED_TOKENS,
        help=f"token budget of one engine step (default: {defaults.MAX_NUM_BATCHED_TOKENS})",
    )
    engine.add_argument(
        "--batch-invariant",
        action="store_true",
        help="bitwise-identical logits for a request whatever its batch and prefill chunking, "
        "at a throughput cost (also DEEPWELL_BATCH_INVARIANT=1)",
    )
    engine.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=defaults.NUM_SPECULATIVE_TOKENS,
        help="draft tokens verified per request and step; 0 turns speculative decoding off "
        f"(default: DEEPWELL_USE_NEXTN_DECODE or 5, now {defaults.NUM_SPECULATIVE_TOKENS})",
    )
    parser.add_argument(
        "--speculative-method",
        choices=defaults.SPECULATIVE_METHODS,
        default=defaults.SPECULATIVE_METHOD,
        help="drafter: n-gram prompt lookup, or DeepSeek-V4.1's DSpark stages "
        "(default: dspark when the checkpoint has them, else ngram)",
    )
    engine.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="run the step loop synchronously instead of planning the next step and handing "
        "back tokens while the model computes (outputs are the same either way)",
    )
    engine.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    cache.add_argument(
        "--block-size",
        type=int,
        default=defaults.BLOCK_SIZE,
        help=f"KV block size in tokens (default: {defaults.BLOCK_SIZE})",
    )
    cache.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=defaults.ENABLE_PREFIX_CACHING,
        help="reuse cached KV blocks of a common prompt prefix; --no-enable-prefix-caching "
        "computes every prompt in full (default: on)",
    )
    # The flag deepwell had before vLLM's spelling.
    cache.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="the same as --no-enable-prefix-caching",
    )
    cache.add_argument(
        "--kv-store",
        metavar="PATH",
        help="directory of KV block files shared by workers, e.g. on 3FS or NFS "
        "(default: none, prefix blocks live in memory only)",
    )
    cache.add_argument(
        "--no-kv-cache-quantization",
        action="store_true",
        help="DeepSeek-V4.1: keep the caches in the engine dtype instead of the fp8/fp4 "
        "formats the model was trained with (for exact comparisons with a reference)",
    )
    groups.engine.add_argument(
        "--yoco-prefill-truncation-mode",
        choices=defaults.YOCO_TRUNCATION_MODES,
        help="DeepSeek-V4.1 SWA bounded replay: off (exact), mask or compact (the consumer "
        "layers' window sees only the last --yoco-prefill-keep-tokens prompt positions) "
        "(default: DEEPWELL_YOCO_PREFILL_TRUNCATION_MODE or "
        f"{defaults.YOCO_PREFILL_TRUNCATION_MODE})",
    )
    groups.engine.add_argument(
        "--yoco-prefill-keep-tokens",
        type=int,
        help="prompt positions the consumer layers keep in mask/compact mode; at least the "
        "window plus the backtracking rows (default: DEEPWELL_YOCO_PREFILL_KEEP_TOKENS or "
        f"{defaults.YOCO_PREFILL_KEEP_TOKENS})",
    )
    groups.engine.add_argument(
        "--quantization",
        choices=defaults.QUANTIZATIONS,
        default=defaults.QUANTIZATION,
        help="int4: linear calls of up to 6 rows (small decode steps) use 4-bit weights in "
        "groups of 32, GGUF Q4_1's format (bf16 only; faster batch-1 decode) "
        f"(default: {defaults.QUANTIZATION})",
    )
    groups.engine.add_argument(
        "--attention-backend",
        choices=defaults.ATTENTION_BACKENDS,
        help="decode attention: cpp (a fused C++ kernel, compiled once per machine on first "
        "use; an error without a compiler), torch (pure torch) or auto (cpp where it builds) "
        f"(default: DEEPWELL_ATTENTION_BACKEND or {defaults.ATTENTION_BACKEND})",
    )
    return groups


def attention_backend_override(args: argparse.Namespace) -> dict[str, str]:
    """--attention-backend when given; else EngineArgs reads DEEPWELL_ATTENTION_BACKEND."""
    return {} if args.attention_backend is None else {"attention_backend": args.attention_backend}


def yoco_overrides(args: argparse.Namespace) -> dict[str, str | int]:
    """The bounded-replay flags that were given; the others keep EngineArgs' environment
    defaults (DEEPWELL_YOCO_PREFILL_*)."""
    given = {
        "yoco_prefill_truncation_mode": args.yoco_prefill_truncation_mode,
        "yoco_prefill_keep_tokens": args.yoco_prefill_keep_tokens,
    }
    return {name: value for name, value in given.items() if value is not None}
