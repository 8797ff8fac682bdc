"""Asynchronous scheduling on a CPU: output tok/s with it on and off, at one and two torch
threads, with DSpark drafting, on a tiny and a medium DeepSeek-V4.1 checkpoint; and where the
step loop's time goes: model work (forward, logits, sampling), DSpark drafting, and the rest,
the CPU side (scheduling, step preparation, commits) that overlap could hide at most.

Each configuration runs in its own process, since libgomp's spinning state outlives a run;
each is the best of `--repeats` runs (a shared machine swings single runs). Greedy, the
checkpoints' random weights (drafts are seldom accepted: every step still drafts). One
command, a few minutes on the tiny checkpoint, prints the table of docs/benchmarks.md
("asynchronous scheduling with DSpark") with the machine's load before and after:

    PYTHONPATH=. .venv/bin/python benchmarks/async_overlap.py [--presets tiny medium] [--threads 1 2]
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(path: str, threads: int, overlap: bool, batch: int, tokens: int) -> dict:
    from deepwell.engine import EngineArgs, EngineCore, SamplingParams

    core = EngineCore(
        EngineArgs(
            model=path,
            num_threads=threads,
            async_scheduling=overlap,
            speculative_method="dspark",
            max_model_len=512,
            memory_gib=2.0,
        )
    )
    drafting = [0.0]
    propose = core._propose_drafts

    def timed_propose():
        started = time.perf_counter()
        try:
            return propose()
        finally:
            drafting[0] += time.perf_counter() - started

    core._propose_drafts = timed_propose
    rng = random.Random(0)
    vocab = core.vocab_size

    def run(count: int, max_tokens: int) -> tuple[float, int]:
        for index in range(count):
            prompt = [rng.randrange(3, vocab - 8) for _ in range(rng.randrange(16, 48))]
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            core.add_request(f"r{time.monotonic_ns()}-{index}", prompt, params)
        started = time.perf_counter()
        generated = 0
        while core.has_unfinished():
            generated += sum(len(o.new_token_ids) for o in core.step())
        return time.perf_counter() - started, generated

    run(batch, 8)  # warm-up: kernels built, pages touched
    drafting[0], compute_before, steps_before = 0.0, core.compute_s, core.num_steps
    wall, generated = run(batch, tokens)
    model = core.compute_s - compute_before
    result = {
        "tok_s": generated / wall,
        "wall_s": wall,
        "steps": core.num_steps - steps_before,
        "model_share": model / wall,
        "drafting_share": drafting[0] / wall,
        "rest_share": max(0.0, wall - model - drafting[0]) / wall,
        "overlapping": core.async_scheduling,
        "accept_rate": core.stats().spec.accept_rate,
    }
    core.close()
    return result


def checkpoint(preset: str, directory: str) -> str:
    path = os.path.join(directory, preset)
    subprocess.run(
        [sys.executable, "-m", "deepwell.cli", "tiny-checkpoint", path, "--preset", preset],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # The medium checkpoint writes and loads 1.1 GiB: opt in.
    parser.add_argument("--presets", nargs="+", default=["tiny"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    # A configuration that crawls (two spinning threads on an oversubscribed host ran at
    # 0.3 tok/s) is reported as timed out instead of holding up the rest of the table.
    parser.add_argument("--run-timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        path, threads, overlap = json.loads(args.measure)
        print(json.dumps(measure(path, threads, overlap, args.batch, args.tokens)))
        return
    print("load average before", " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
    print("| checkpoint | threads | async | tok/s | steps | model | drafting | rest | accept |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as directory:
        for preset in args.presets:
            path = checkpoint(preset, directory)
            for threads in args.threads:
                for overlap in (False, True):
                    runs = []
                    for _ in range(args.repeats):
                        command = [
                            sys.executable,
                            str(Path(__file__).resolve()),
                            "--batch",
                            str(args.batch),
                            "--tokens",
                            str(args.tokens),
                            "--measure",
                            json.dumps([path, threads, overlap]),
                        ]
                        try:
                            run = subprocess.run(
                                command, capture_output=True, text=True, timeout=args.run_timeout
                            )
                        except subprocess.TimeoutExpired:
                            continue
                        if run.returncode:
                            sys.exit(
                                f"{preset}, {threads} threads, async {overlap}: the run failed\n"
                                f"{run.stderr}"
                            )
                        out = run.stdout
                        runs.append(json.loads(out.strip().splitlines()[-1]))
                    label = f"| {preset} | {threads} | {'on' if overlap else 'off'} |"
                    if not runs:
                        print(f"{label} timed out (> {args.run_timeout:.0f} s a run) |", flush=True)
                        continue
                    best = max(runs, key=lambda r: r["tok_s"])
                    print(
                        f"{label} {best['tok_s']:.1f} | {best['steps']} | {best['model_share']:.0%} | "
                        f"{best['drafting_share']:.0%} | {best['rest_share']:.0%} | "
                        f"{best['accept_rate']:.2f} |",
                        flush=True,
                    )
    print("load average after", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
