"""The engine's serial phases in W's 64-row decode steps (schedule, prepare, sample, commit),
thread CPU time: this tree against a baseline tree, each round in fresh processes.

Each process starts all of W's requests (benchmarks/workload.py; greedy, ignore_eos,
speculation off, one torch thread, synchronous steps), steps until every one has its first
token, then times `--steps` decode steps of 64 rows: per phase the median thread CPU time
(`time.thread_time`, which moves far less with a shared machine's load than wall time).
Rounds alternate which tree runs first; the medians over rounds and this tree's ratio to
the baseline's are printed. With two torch threads these phases run on the step loop's
thread while the other core waits: they bound W's scaling (docs/benchmarks.md).

    PYTHONPATH=. .venv/bin/python benchmarks/decode_phases.py --baseline /work/main
"""

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

from trees_in_turn import medians_in_turn

PHASES = ("schedule", "prepare", "sample", "commit")


def measure(steps: int) -> dict[str, float]:
    """Median thread CPU ms per phase over `steps` 64-row decode steps of W."""
    from workload import make_workload

    from deepwell.engine import EngineArgs, EngineCore, SamplingParams

    core = EngineCore(
        EngineArgs(
            dtype="bfloat16",
            enable_prefix_caching=False,
            num_speculative_tokens=0,
            async_scheduling=False,
            num_threads=1,
        )
    )
    seconds: dict[str, list[float]] = defaultdict(list)

    def timed(owner, name: str, phase: str) -> None:
        method = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.thread_time()
            result = method(*args, **kwargs)
            seconds[phase].append(time.thread_time() - start)
            return result

        setattr(owner, name, wrapper)

    timed(core.scheduler, "schedule", "schedule")
    timed(core.runner, "prepare", "prepare")
    timed(core.runner, "sample", "sample")
    timed(core.pipeline, "_commit", "commit")
    workload = make_workload()
    for request in workload:
        params = SamplingParams(max_tokens=request["output_len"], temperature=0, ignore_eos=True)
        core.add_request(str(request["id"]), request["prompt_ids"], params)
    started: set[str] = set()
    while len(started) < len(workload):
        started |= {out.request_id for out in core.step() if out.new_token_ids}
    seconds.clear()
    for _ in range(steps):
        core.step()
    return {phase: statistics.median(seconds[phase]) * 1e3 for phase in PHASES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="the tree to compare against")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.steps)))
        return
    medians = medians_in_turn(
        __file__, args.baseline, args.rounds, PHASES, ["--steps", str(args.steps)]
    )
    print(f"load average {os.getloadavg()[0]:.2f}; median thread CPU ms of {args.steps} steps")
    for name, phases in medians.items():
        total = sum(phases.values())
        row = ", ".join(f"{p} {v:.3f}" for p, v in phases.items())
        print(f"  {name:8} {row}, sum {total:.3f}")
    ratios = ", ".join(f"{p} {medians['this'][p] / medians['baseline'][p]:.2f}" for p in PHASES)
    total_ratio = sum(medians["this"].values()) / sum(medians["baseline"].values())
    print(f"  this / baseline: {ratios}, sum {total_ratio:.2f}")


if __name__ == "__main__":
    main()
