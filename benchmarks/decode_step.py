"""One W decode step (64 running requests) with decode attention in the C++ kernel against
the torch path: two engines in one process, stepped in turn.

Both engines (embedded SmolLM2, synchronous steps, no speculation, no prefix cache) take W's
64 requests (../shared/bench/workload.py) and step until every prompt is prefilled; then
they take `--steps` decode steps each, alternating, so both see the same contexts and a busy
machine slows both alike. Prints each engine's median step time and the load average.

    .venv/bin/python benchmarks/decode_step.py [--threads 1] [--dtype bfloat16] [--steps 30]
"""

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch

from deepwell.engine import EngineArgs, EngineCore, SamplingParams

WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "bench" / "workload.py"


def load_w() -> list[dict]:
    spec = importlib.util.spec_from_file_location("workload", WORKLOAD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_workload()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workload = load_w()
    cores = {
        choice: EngineCore(
            EngineArgs(
                dtype=args.dtype,
                attention_backend=choice,
                enable_prefix_caching=False,
                num_speculative_tokens=0,
                async_scheduling=False,
                num_threads=args.threads,
            )
        )
        for choice in ("torch", "cpp")
    }
    for core in cores.values():
        for request in workload:
            params = SamplingParams(
                max_tokens=request["output_len"], temperature=0, ignore_eos=True
            )
            core.add_request(str(request["id"]), request["prompt_ids"], params)
        # Until every request has its first token: then each step decodes all 64.
        started: set[str] = set()
        while len(started) < len(workload):
            started |= {out.request_id for out in core.step() if out.new_token_ids}
    times: dict[str, list[float]] = {choice: [] for choice in cores}
    rows: dict[str, list[int]] = {choice: [] for choice in cores}
    for _ in range(args.steps):
        for choice, core in cores.items():
            began = time.perf_counter()
            outputs = core.step()
            times[choice].append(time.perf_counter() - began)
            rows[choice].append(len(outputs))
    assert rows["cpp"] == rows["torch"], "the engines drifted apart"
    medians = {choice: statistics.median(t) * 1e3 for choice, t in times.items()}
    print(
        f"W decode step: {min(rows['cpp'])}-{max(rows['cpp'])} rows, {args.dtype}, "
        f"{args.threads} thread(s), {args.steps} steps each, alternating; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    for choice, median in medians.items():
        print(f"  {choice:5s} median {median:.1f} ms")
    print(f"  speed-up {medians['torch'] / medians['cpp']:.2f}x")


if __name__ == "__main__":
    main()
