"""Decode tok/s at each batch size: deepwell against llama.cpp on the same GGUF and threads.

Each of B sequences has its own 64-token prompt (W's first B prompts cut to 64 tokens: no
shared prefix), then all B decode n tokens together: tok/s = B n / (time of n + 1 tokens -
time of 1 token), the mean of `--repetitions` runs. deepwell: `LLM.generate`, speculation
off, no prefix cache, greedy, EOS ignored, each `--quantizations` value in its own process.
llama.cpp (benchmarks/llama_cpp_peer.py; its build must be in the cache):
`llama-batched-bench` (its decode steps feed a fixed token: the same compute) with the
weights repacked (its default: on an AMX CPU its AMX tile kernels) and in plain buffers, and
at batch 1 also its tg128 at its defaults (the repacked VNNI decode kernel); its best of
these is the figure at each batch size.

Prints, per batch size, each engine's tok/s and `decode ratio at batch B (deepwell best /
llama.cpp best): X`.

    .venv/bin/python benchmarks/decode_batches.py [--threads 2] [--batch-sizes 1,2,4,8,16,32]
        [--tokens 128] [--repetitions 2] [--quantizations none,int4] [--json out.json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp_peer as llama_cpp
from throughput_vs_hf import load_workload

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 64


def prompts(batch: int) -> list[list[int]]:
    workload = load_workload()[0]
    if batch > len(workload):
        sys.exit(f"batch sizes go up to W's {len(workload)} requests")
    return [r["prompt_ids"][:PROMPT_TOKENS] for r in workload[:batch]]


def child(args) -> dict[int, float]:
    import torch

    from deepwell.engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(
        enable_prefix_caching=False,
        num_speculative_tokens=0,
        quantization=args.quantization,
        num_threads=args.threads,
        decode_sequence=False,
    )
    greedy = {"temperature": 0, "ignore_eos": True}

    def timed(batch: list[list[int]], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, **greedy)
        start = time.perf_counter()
        llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
        return time.perf_counter() - start

    timed(prompts(1), 8)
    rates = {}
    for size in args.batch_sizes:
        batch = prompts(size)
        runs = []
        for _ in range(args.repetitions):
            first = timed(batch, 1)
            full = timed(batch, args.tokens + 1)
            runs.append(size * args.tokens / (full - first))
        rates[size] = statistics.fmean(runs)
        print(
            f"  deepwell {args.quantization}, batch {size}: {rates[size]:.1f} tok/s",
            file=sys.stderr,
            flush=True,
        )
    return rates


def run_child(args, quantization: str) -> dict[int, float]:
    command = [
        sys.executable,
        __file__,
        "--child",
        *("--quantization", quantization, "--threads", str(args.threads)),
        *("--batch-sizes", ",".join(map(str, args.batch_sizes)), "--tokens", str(args.tokens)),
        *("--repetitions", str(args.repetitions)),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    result = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    if result.returncode:
        sys.exit(f"deepwell --quantization {quantization} failed (exit {result.returncode})")
    return {int(size): rate for size, rate in json.loads(result.stdout.splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quantization", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads, every engine")
    parser.add_argument(
        "--batch-sizes",
        type=lambda text: [int(s) for s in text.split(",")],
        default=[1, 2, 4, 8, 16, 32],
        help="sequences decoding together (comma-separated, up to 64)",
    )
    parser.add_argument("--tokens", type=int, default=128, help="decode steps per run")
    parser.add_argument("--repetitions", type=int, default=2, help="runs per batch size, averaged")
    parser.add_argument(
        "--quantizations",
        type=lambda text: text.split(","),
        default=["none", "int4"],
        help="deepwell's --quantization values (comma-separated)",
    )
    parser.add_argument(
        "--llama-cpp-cache", type=Path, default=llama_cpp.CACHE_DIR, help="llama.cpp's build"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return

    llama = llama_cpp.find_llama_cpp(args.llama_cpp_cache)
    if llama is None:
        sys.exit(llama_cpp.missing_build(args.llama_cpp_cache))
    print(
        f"{args.threads} threads, batches {args.batch_sizes}, {PROMPT_TOKENS}-token prompts,"
        f" {args.tokens} decode steps; {llama_cpp.describe(llama)};"
        f" load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    engines: dict[str, dict[int, float]] = {}
    for quantization in args.quantizations:
        engines[f"deepwell {quantization}"] = run_child(args, quantization)
    for repack, name in ((True, "llama.cpp repacked"), (False, "llama.cpp plain buffers")):
        rows = llama_cpp.batched_decode(
            llama, args.threads, args.batch_sizes, PROMPT_TOKENS, args.tokens, repack
        )
        engines[name] = {row.batch: row.tok_s for row in rows}
    if 1 in args.batch_sizes:
        engines["llama.cpp tg128 (repacked)"] = {1: llama_cpp.tg128(llama, args.threads).tok_s}
    print(f"load average {os.getloadavg()[0]:.2f}")
    names = list(engines)
    print("batch  " + "  ".join(f"{name:>26}" for name in names))
    summary = {"threads": args.threads, "tokens": args.tokens, "engines": engines, "ratios": {}}
    for size in args.batch_sizes:
        cells = [engines[name].get(size) for name in names]
        print(f"{size:5d}  " + "  ".join(f"{c:26.1f}" if c else f"{'—':>26}" for c in cells))
    for size in args.batch_sizes:
        ours = max(engines[n][size] for n in names if n.startswith("deepwell"))
        theirs = max(engines[n].get(size, 0.0) for n in names if n.startswith("llama.cpp"))
        summary["ratios"][size] = ours / theirs
        print(f"decode ratio at batch {size} (deepwell best / llama.cpp best): {ours / theirs:.2f}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
