"""Workload W greedy against W sampled (temperature 0.8, top_p 0.95, seeded): what sampling
costs on the traffic users send, each run in its own process, alternating.

W is benchmarks/workload.py's (the first `--requests` of its 64), run as
benchmarks/throughput_vs_hf.py runs deepwell: `LLM.generate`, speculation off, no prefix
cache, EOS ignored, one warm-up generate first. A round runs greedy then sampled, each in a
fresh child process with the same torch threads; each side keeps its fastest round. Prints
each run's output tok/s, wall and CPU seconds (the child's own, which a loaded machine
inflates less than wall time) and the load average, then `sampled/greedy: X (wall), Y (CPU)`.

    PYTHONPATH=. .venv/bin/python benchmarks/sampled_w.py [--threads 2] [--rounds 2] \
        [--requests 64] [--temperature 0.8] [--top-p 0.95] [--top-k -1] [--json out.json]
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from workload import make_workload

ROOT = Path(__file__).resolve().parents[1]
MODES = ("greedy", "sampled")


def child(args) -> None:
    import torch

    from deepwell.engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    workload = make_workload()[: args.requests]
    llm = LLM(
        dtype=args.dtype,
        enable_prefix_caching=False,
        num_speculative_tokens=0,
        decode_sequence=False,
    )

    def params(request: dict, index: int) -> SamplingParams:
        if args.child == "greedy":
            return SamplingParams(max_tokens=request["output_len"], temperature=0, ignore_eos=True)
        return SamplingParams(
            max_tokens=request["output_len"],
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=index,
            ignore_eos=True,
        )

    warm = workload[0]["prompt_ids"][:64]
    llm.generate(
        prompt_token_ids=[warm], sampling_params=params({"output_len": 8}, 0), use_tqdm=False
    )
    prompts = [r["prompt_ids"] for r in workload]
    sampling = [params(r, i) for i, r in enumerate(workload)]
    cpu, wall = time.process_time(), time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=sampling, use_tqdm=False)
    result = {"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu}
    print(json.dumps(result), flush=True)


def run_child(args, mode: str) -> dict:
    command = [sys.executable, __file__, "--child", mode]
    for name in ("threads", "requests", "dtype", "temperature", "top_p", "top_k"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{mode} run failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--requests", type=int, default=64, help="W's first N requests")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    workload = make_workload()[: args.requests]
    tokens = sum(r["output_len"] for r in workload)
    print(
        f"W: {len(workload)} requests, {tokens} output tokens; {args.threads} threads,"
        f" {args.dtype}; sampled = temperature {args.temperature}, top_p {args.top_p},"
        f" top_k {args.top_k}",
        flush=True,
    )
    best: dict[str, dict] = {}
    for round_index in range(args.rounds):
        for mode in MODES:
            result = run_child(args, mode)
            load = os.getloadavg()[0]
            print(
                f"round {round_index + 1} {mode}: {tokens / result['seconds']:.1f} tok/s,"
                f" {result['seconds']:.1f} s wall, {result['cpu_seconds']:.1f} s CPU"
                f" (load average {load:.2f})",
                flush=True,
            )
            kept = best.setdefault(mode, result)
            kept["seconds"] = min(kept["seconds"], result["seconds"])
            kept["cpu_seconds"] = min(kept["cpu_seconds"], result["cpu_seconds"])
    greedy, sampled = best["greedy"], best["sampled"]
    summary = {
        "tokens": tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "greedy_tok_s": tokens / greedy["seconds"],
        "sampled_tok_s": tokens / sampled["seconds"],
        "ratio_wall": greedy["seconds"] / sampled["seconds"],
        "ratio_cpu": greedy["cpu_seconds"] / sampled["cpu_seconds"],
    }
    print(
        f"greedy {summary['greedy_tok_s']:.1f} tok/s, sampled {summary['sampled_tok_s']:.1f}"
        f" tok/s; sampled/greedy: {summary['ratio_wall']:.3f} (wall),"
        f" {summary['ratio_cpu']:.3f} (CPU)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
