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
        "--expand-weights",
        action="store_true",
        help="DeepSeek-V4.1: dequantise the FP8/MXFP4 weights to the engine dtype at load "
        "(the reference path, several times the memory; also DEEPWELL_EXPAND_WEIGHTS=1)",
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
        "--context-parallel-size",
        type=int,
        default=defaults.CONTEXT_PARALLEL_SIZE,
        help="DeepSeek-V4.1: processes on this machine that share each long prefill (mirror "
        "context parallelism over torch.distributed/gloo); rank 0 decodes "
        f"(default: {defaults.CONTEXT_PARALLEL_SIZE}, off)",
    )
    groups.engine.add_argument(
        "--context-parallel-min-tokens",
        type=int,
        help="prefills from the prompt start of at least this many tokens run across the "
        "context-parallel ranks, shorter ones on rank 0 (default: twice the model's "
        "sliding window)",
    )
    groups.engine.add_argument(
        "--quantization",
        choices=defaults.QUANTIZATIONS,
        default=defaults.QUANTIZATION,
        help="int4: linear calls of a few rows (decode steps of up to 8 rows) multiply GGUF "
        "blocks "
        "with int8 activations, Q4_1 for the layers and Q8_0 for the output head (a GGUF "
        "checkpoint's own blocks, else quantised at load; faster batch-1 decode) "
        f"(default: {defaults.QUANTIZATION})",
    )
    groups.engine.add_argument(
        "--attention-backend",
        choices=defaults.ATTENTION_BACKENDS,
        help="decode attention: cpp (a fused C++ kernel, compiled once per machine on first "
        "use; an error without a compiler), torch (pure torch) or auto (cpp where it builds) "
        f"(default: DEEPWELL_ATTENTION_BACKEND or {defaults.ATTENTION_BACKEND})",
    )
    groups.engine.add_argument(
        "--native-decode",
        choices=defaults.NATIVE_DECODES,
        help="auto: Llama-family decode steps of a few rows run every layer in one C++ call "
        "where the model has --quantization int4 linears and the cpp attention; off: always "
        f"the torch path (default: DEEPWELL_NATIVE_DECODE or {defaults.NATIVE_DECODE})",
    )
    return groups


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """`--data-parallel-size`, `--expert-parallel`, EPLB and the rendezvous (generate, serve)."""
    group = parser.add_argument_group(
        "parallelism (torch.distributed; docs/parallel.md)",
        "attention data parallelism with MoE expert parallelism and EPLB; the ranks of this "
        "machine are started for you (`deepwell generate` also runs as one torchrun rank)",
    )
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="engine ranks, each with its own scheduler, KV cache and requests (default: 1)",
    )
    group.add_argument(
        "--expert-parallel",
        action="store_true",
        help="shard the routed experts over the data-parallel ranks (EP size = DP size); "
        "tokens move to their experts' ranks by all-to-all each MoE layer (MoE models only)",
    )
    group.add_argument(
        "--enable-eplb",
        action="store_true",
        help="expert-parallel load balancing: re-place experts (and replicas of hot ones) "
        "by their token counts every --eplb-window-steps steps",
    )
    group.add_argument(
        "--eplb-window-steps",
        type=int,
        default=32,
        metavar="STEPS",
        help="steps of token counts behind each EPLB re-placement (default: 32)",
    )
    group.add_argument(
        "--eplb-min-gain",
        type=float,
        default=0.05,
        metavar="G",
        help="move a layer's experts only when the new placement lowers its window's "
        "max/mean rank load by at least G, so that noise in the counts moves no weights "
        "(default: 0.05; 0 re-places at every window)",
    )
    group.add_argument(
        "--eplb-redundant-experts",
        type=int,
        default=0,
        metavar="N",
        help="extra expert slots EPLB fills with replicas of hot experts; also makes the "
        "slots divide over the ranks (default: 0)",
    )
    group.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="address of global rank 0's machine, where the ranks meet (default: 127.0.0.1)",
    )
    group.add_argument(
        "--master-port", type=int, default=29500, help="its rendezvous port (default: 29500)"
    )
    group.add_argument(
        "--nnodes", type=int, default=1, help="machines the ranks span, equally (default: 1)"
    )
    group.add_argument(
        "--node-rank", type=int, default=0, help="this machine's index among them (default: 0)"
    )


def parallel_fields(args: argparse.Namespace) -> dict[str, int | float | bool | str]:
    """The ParallelConfig fields the parallelism flags set."""
    return {
        "data_parallel_size": args.data_parallel_size,
        "expert_parallel": args.expert_parallel,
        "enable_eplb": args.enable_eplb,
        "eplb_window_steps": args.eplb_window_steps,
        "eplb_min_gain": args.eplb_min_gain,
        "eplb_redundant_experts": args.eplb_redundant_experts,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
    }


def kernel_overrides(args: argparse.Namespace) -> dict[str, str]:
    """--attention-backend and --native-decode where given; else EngineArgs reads
    DEEPWELL_ATTENTION_BACKEND / DEEPWELL_NATIVE_DECODE."""
    given = {"attention_backend": args.attention_backend, "native_decode": args.native_decode}
    return {name: value for name, value in given.items() if value is not None}


def yoco_overrides(args: argparse.Namespace) -> dict[str, str | int]:
    """The bounded-replay flags that were given; the others keep EngineArgs' environment
    defaults (DEEPWELL_YOCO_PREFILL_*)."""
    given = {
        "yoco_prefill_truncation_mode": args.yoco_prefill_truncation_mode,
        "yoco_prefill_keep_tokens": args.yoco_prefill_keep_tokens,
    }
    return {name: value for name, value in given.items() if value is not None}
