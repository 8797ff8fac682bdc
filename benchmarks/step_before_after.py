"""Batch-1 decode tok/s and the W decode step time of two source trees, in alternating child
processes (a busy machine slows both alike).

Each child imports `deepwell` from its tree (PYTHONPATH) and runs the embedded SmolLM2 with
speculation off and one torch thread: batch-1 decode as benchmarks/throughput_vs_hf.py
measures it (`LLM.generate`, asynchronous scheduling; 64-token prompt of W's first request;
time for 129 tokens − time for 1, over 128), then, in synchronous steps, W's 64 requests
stepped until each has its first token and `--steps` decode steps timed (median). Prints each tree's median over `--rounds` and the load average.

    .venv/bin/python benchmarks/step_before_after.py --before /work/main --after . \\
        [--dtype bfloat16] [--rounds 3] [--steps 20]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from workload import make_workload


def child(dtype: str, steps: int) -> dict:
    from deepwell.engine import LLM, EngineArgs, EngineCore, SamplingParams

    workload = make_workload()
    greedy = {"temperature": 0, "ignore_eos": True}
    llm = LLM(
        dtype=dtype,
        enable_prefix_caching=False,
        num_speculative_tokens=0,
        num_threads=1,
        decode_sequence=False,
    )
    prompt = workload[0]["prompt_ids"][:64]

    def timed(max_tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(
            prompt_token_ids=[prompt],
            sampling_params=SamplingParams(max_tokens=max_tokens, **greedy),
            use_tqdm=False,
        )
        return time.perf_counter() - start

    timed(8)
    decode_tok_s = 128 / (timed(129) - timed(1))
    llm.core.close()
    core = EngineCore(
        EngineArgs(
            dtype=dtype,
            enable_prefix_caching=False,
            num_speculative_tokens=0,
            async_scheduling=False,
            num_threads=1,
        )
    )
    for request in workload:
        params = SamplingParams(max_tokens=request["output_len"], **greedy)
        core.add_request(str(request["id"]), request["prompt_ids"], params)
    started: set[str] = set()
    while len(started) < len(workload):
        started |= {out.request_id for out in core.step() if out.new_token_ids}
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        walls.append(time.perf_counter() - start)
    return {"decode_tok_s": decode_tok_s, "w_step_ms": statistics.median(walls) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="source tree holding `deepwell`")
    parser.add_argument("--after", required=True, help="source tree holding `deepwell`")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.dtype, args.steps)))
        return
    results: dict[str, list[dict]] = {"before": [], "after": []}
    loads = []
    for _ in range(args.rounds):
        for label in ("before", "after"):
            tree = str(Path(getattr(args, label)).resolve())
            command = [sys.executable, __file__, "--child", "--before", "-", "--after", "-"]
            command += ["--dtype", args.dtype, "--steps", str(args.steps)]
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            results[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
            loads.append(os.getloadavg()[0])
            print(label, results[label][-1], f"load {loads[-1]:.2f}", flush=True)
    print(
        f"{args.dtype}, 1 thread, {args.rounds} rounds alternating, "
        f"load average {min(loads):.2f}-{max(loads):.2f}"
    )
    for label, runs in results.items():
        decode = statistics.median(r["decode_tok_s"] for r in runs)
        step = statistics.median(r["w_step_ms"] for r in runs)
        print(f"  {label:6s} batch-1 decode {decode:.1f} tok/s, W decode step {step:.1f} ms")


if __name__ == "__main__":
    main()
