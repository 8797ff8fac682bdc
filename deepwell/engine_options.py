"""The command-line options that set the engine, shared by `generate`, `bench` and `serve`.

Free of torch imports, so the HTTP process can build its parser without loading the engine.
"""

from __future__ import annotations

import argparse

from deepwell import engine_defaults as defaults


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, KV cache, batch invariance, speculation, step overlap and threads: the options
    every engine user has."""
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="a .gguf file or a directory with config.json + safetensors "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--memory-gib",
        type=float,
        default=defaults.MEMORY_GIB,
        help=f"memory budget for weights plus KV cache, in GiB (default: {defaults.MEMORY_GIB:g})",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=defaults.BLOCK_SIZE,
        help=f"KV block size in tokens (default: {defaults.BLOCK_SIZE})",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="bitwise-identical logits for a request whatever its batch and prefill chunking, "
        "at a throughput cost (also DEEPWELL_BATCH_INVARIANT=1)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt in full instead of reusing cached KV blocks",
    )
    parser.add_argument(
        "--kv-store",
        metavar="PATH",
        help="directory of KV block files shared by workers, e.g. on 3FS or NFS "
        "(default: none, prefix blocks live in memory only)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=defaults.NUM_SPECULATIVE_TOKENS,
        help="n-gram draft tokens verified per request and step; 0 turns speculative "
        f"decoding off (default: {defaults.NUM_SPECULATIVE_TOKENS})",
    )
    parser.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="run the step loop synchronously instead of planning the next step and handing "
        "back tokens while the model computes (outputs are the same either way)",
    )
    parser.add_argument(
        "--no-kv-cache-quantization",
        action="store_true",
        help="DeepSeek-V4.1: keep the caches in the engine dtype instead of the fp8/fp4 "
        "formats the model was trained with (for exact comparisons with a reference)",
    )
    parser.add_argument(
        "--quantization",
        choices=defaults.QUANTIZATIONS,
        default=defaults.QUANTIZATION,
        help="int4: linear calls of up to 6 rows (small decode steps) use 4-bit weights in "
        "groups of 32, GGUF Q4_1's format (bf16 only; faster batch-1 decode) "
        f"(default: {defaults.QUANTIZATION})",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
