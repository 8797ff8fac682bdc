"""One prompt of N tokens: deepwell's prefill tok/s against llama.cpp's ppN (llama-bench -p N)
on the same GGUF and threads, each in its own process.

deepwell: `LLM.generate` of N random ordinary token ids (W's vocabulary, seeded), one output
token, no prefix cache, `--quantization int4` as the other llama.cpp rows run (a prompt's
linears run the dense weights either way): N / the fastest of `--repetitions` runs, so the
figure holds the one decode step that samples the first token. llama.cpp: llama-bench's mean
ppN at its defaults (benchmarks/llama_cpp_peer.py: the weights repacked, on an AMX CPU into
its AMX tile kernels, its fastest there). Prints `prompt ratio at N tokens (deepwell /
llama.cpp ppN): X`.

    PYTHONPATH=. .venv/bin/python benchmarks/prompt_vs_llama_cpp.py [--n-prompt 512]
        [--threads 2] [--repetitions 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp_peer as llama_cpp
from workload import VOCAB

ROOT = Path(__file__).resolve().parents[1]
PROMPT_SEED = 512


def prompt_ids(length: int) -> list[int]:
    rng = random.Random(PROMPT_SEED)
    return [rng.randrange(*VOCAB) for _ in range(length)]


def deepwell_prefill(threads: int, length: int, repetitions: int) -> float:
    """Prompt tok/s of the fastest run."""
    import torch

    from deepwell.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(
        enable_prefix_caching=False,
        num_speculative_tokens=0,
        quantization="int4",
        num_threads=threads,
        decode_sequence=False,
    )
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompt = prompt_ids(length)
    best = float("inf")
    for _ in range(repetitions + 1):
        start = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return length / best


def run_deepwell(args) -> float:
    command = [sys.executable, __file__, "--child", "--threads", str(args.threads)]
    command += ["--n-prompt", str(args.n_prompt), "--repetitions", str(args.repetitions)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    result = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    if result.returncode:
        sys.exit(f"deepwell's prefill failed (exit {result.returncode})")
    return json.loads(result.stdout.splitlines()[-1])["tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--n-prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="both engines")
    parser.add_argument("--repetitions", type=int, default=5, help="runs of each engine")
    parser.add_argument(
        "--llama-cpp-cache", type=Path, default=llama_cpp.CACHE_DIR, help="llama.cpp's build"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.child:
        tok_s = deepwell_prefill(args.threads, args.n_prompt, args.repetitions)
        print(json.dumps({"tok_s": tok_s}), flush=True)
        return

    llama = llama_cpp.find_llama_cpp(args.llama_cpp_cache)
    if llama is None:
        sys.exit(llama_cpp.missing_build(args.llama_cpp_cache))
    print(
        f"{args.n_prompt}-token prompt, {args.threads} threads; SIMD flags:"
        f" {' '.join(llama_cpp.simd_flags())}; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    ours = run_deepwell(args)
    (theirs,) = llama_cpp.llama_bench(llama, args.threads, args.n_prompt, 0, args.repetitions)
    print(f"  deepwell int4: {ours:.1f} prompt tok/s")
    print(
        f"  llama.cpp {theirs.test}, repack {'on' if theirs.repack else 'off'}:"
        f" {theirs.tok_s:.1f} ± {theirs.stddev_tok_s:.1f} tok/s ({llama_cpp.describe(llama)})"
    )
    print(f"load average {os.getloadavg()[0]:.2f}")
    ratio = ours / theirs.tok_s
    print(
        f"prompt ratio at {args.n_prompt} tokens (deepwell / llama.cpp {theirs.test}): {ratio:.2f}"
    )
    if args.json:
        summary = {
            "n_prompt": args.n_prompt,
            "threads": args.threads,
            "deepwell_tok_s": ours,
            "llama_cpp_tok_s": theirs.tok_s,
            "ratio": ratio,
        }
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
