"""Workload W's wall time with the step loop overlapped (asynchronous scheduling) and not, at
`--threads` torch threads, speculation off, greedy: the CPU side (schedule, prepare, commit)
that overlap hides against what it costs at two threads.

Each run is a process of its own (libgomp's pools and spinning state outlive a run), the
modes alternate for `--rounds`, and each keeps its fastest. Per run: W's wall seconds and
output tok/s, the process's CPU seconds (all threads, spinning included) and its threads'
voluntary context switches a step, which count how often an OpenMP worker went to sleep
between parallel regions (libgomp's throttled spinning: docs/benchmarks-log.md, "W's wall
time at two threads"). The greedy tokens of every run must be equal.

    PYTHONPATH=. .venv/bin/python benchmarks/async_w.py [--threads 2] [--rounds 2]
        [--requests 64]
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
MODES = {"sync": False, "async": True}


def voluntary_switches() -> int:
    """Voluntary context switches of every thread of this process so far."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                total += int(line.split()[1])
    return total


def child(mode: str, threads: int, requests: int) -> dict:
    from deepwell.engine import EngineArgs, EngineCore, SamplingParams

    core = EngineCore(
        EngineArgs(
            enable_prefix_caching=False,
            num_speculative_tokens=0,
            num_threads=threads,
            async_scheduling=MODES[mode],
        )
    )
    workload = make_workload(requests=requests)
    greedy = {"temperature": 0, "ignore_eos": True}
    core.add_request("warm", workload[0]["prompt_ids"][:64], SamplingParams(max_tokens=8, **greedy))
    while core.has_unfinished():
        core.step()
    for request in workload:
        params = SamplingParams(max_tokens=request["output_len"], **greedy)
        core.add_request(str(request["id"]), request["prompt_ids"], params)
    tokens: dict[str, list[int]] = {}
    steps, switches = 0, voluntary_switches()
    wall, cpu = time.perf_counter(), time.process_time()
    while core.has_unfinished():
        steps += 1
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    core.close()
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tokens": sum(map(len, tokens.values())),
        "switches_a_step": (voluntary_switches() - switches) / steps,
        "tokens": tokens,
    }


def run(args, mode: str) -> dict:
    command = [sys.executable, __file__, "--child", mode, "--threads", str(args.threads)]
    command += ["--requests", str(args.requests)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64, help="W's first N requests")
    parser.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.threads, args.requests)))
        return
    print(f"W[:{args.requests}], {args.threads} threads; load average {os.getloadavg()[0]:.2f}")
    best: dict[str, dict] = {}
    tokens = None
    for index in range(args.rounds):
        for mode in MODES:
            result = run(args, mode)
            if tokens is None:
                tokens = result["tokens"]
            elif result["tokens"] != tokens:
                sys.exit(f"round {index + 1}, {mode}: greedy tokens differ from the first run's")
            print(
                f"round {index + 1} {mode}: W {result['wall_s']:.1f} s, "
                f"{result['output_tokens'] / result['wall_s']:.1f} tok/s, CPU "
                f"{result['cpu_s']:.1f} s, {result['switches_a_step']:.0f} voluntary switches "
                f"a step (load average {os.getloadavg()[0]:.2f})",
                flush=True,
            )
            if mode not in best or result["wall_s"] < best[mode]["wall_s"]:
                best[mode] = result
    ratio = best["sync"]["wall_s"] / best["async"]["wall_s"]
    print(f"W wall ratio, sync/async (fastest of {args.rounds}): {ratio:.2f}")


if __name__ == "__main__":
    main()
