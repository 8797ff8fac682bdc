"""One W decode step (64 running requests) with decode attention in the C++ kernel against
the torch path: two engines in one process, stepped in turn.

Both engines (embedded SmolLM2, synchronous steps, no speculation, no prefix cache) take W's
64 requests (benchmarks/workload.py) and step until every prompt is prefilled; then
they take `--steps` decode steps each, alternating, so both see the same contexts and a busy
machine slows both alike. Prints each engine's median step time (wall and process CPU) and
the load average.

    .venv/bin/python benchmarks/decode_step.py [--threads 1] [--dtype bfloat16] [--steps 30]
"""

import argparse
import os
import statistics
import time

import torch
from workload import make_workload

from deepwell.engine import EngineArgs, EngineCore, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workload = make_workload()
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
    # Wall time, and the process's CPU time, which a busy machine inflates less (waiting for
    # a core is not counted).
    walls: dict[str, list[float]] = {choice: [] for choice in cores}
    cpus: dict[str, list[float]] = {choice: [] for choice in cores}
    rows: dict[str, list[int]] = {choice: [] for choice in cores}
    for _ in range(args.steps):
        for choice, core in cores.items():
            wall, cpu = time.perf_counter(), time.process_time()
            outputs = core.step()
            walls[choice].append(time.perf_counter() - wall)
            cpus[choice].append(time.process_time() - cpu)
            rows[choice].append(len(outputs))
    assert rows["cpp"] == rows["torch"], "the engines drifted apart"
    wall = {choice: statistics.median(t) * 1e3 for choice, t in walls.items()}
    cpu = {choice: statistics.median(t) * 1e3 for choice, t in cpus.items()}
    print(
        f"W decode step: {min(rows['cpp'])}-{max(rows['cpp'])} rows, {args.dtype}, "
        f"{args.threads} thread(s), {args.steps} steps each, alternating; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    for choice in cores:
        print(f"  {choice:5s} median wall {wall[choice]:.1f} ms, CPU {cpu[choice]:.1f} ms")
    print(
        f"  speed-up: wall {wall['torch'] / wall['cpp']:.2f}x, CPU {cpu['torch'] / cpu['cpp']:.2f}x"
    )


if __name__ == "__main__":
    main()
