"""Cost of batch invariance per decode step at fixed batch sizes: the invariant path against
the default, each run in its own process, the two alternating round by round.

A run prefills `--batch` seeded 64-token prompts (speculation, prefix cache and
asynchronous scheduling off), then times `--steps` synchronous decode steps: median wall
and CPU (process) milliseconds a step. CPU time is the figure to read on a shared machine
(wall time counts the neighbours too). Each round keeps its own figures; the ratio is of
the medians over rounds:

    .venv/bin/python benchmarks/invariance_cost.py [--batch 1 16] [--rounds 2] [--v41 tiny]
        [--json out.json]
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/invariance_cost.py  # AVX2 forced

ATEN_CPU_CAPABILITY caps torch's own kernels and ours (decode_kernel.py builds at its level),
but not MKL, which runs the default path's float32 linears and head at its own best (AVX-512
and AMX here): with avx2 asked, the runs also get the rest of benchmarks/forced_avx2.py's
environment (MKL and oneDNN at AVX2) unless set, so that both sides run what an AVX2-only
CPU runs.

Goal (issue 33 item 6): invariant ≤ 1.2× the default at batch 1 and 16.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from forced_avx2 import AVX2_ENVIRONMENT

PROMPT_TOKENS = 64
# Past the prompt's ids, ordinary text ids of SmolLM2 and bytes of V4.1's vocabulary.
FIRST_ID = 100
V41_MAX_MODEL_LEN = 1024
V41_MEMORY_GIB = 0.5
WARMUP_STEPS = 5


def one_run(model: str | None, invariant: bool, batch: int, steps: int) -> dict:
    """Time `steps` decode steps of one engine in this process."""
    from deepwell.engine import EngineArgs, EngineCore, SamplingParams

    extra = {}
    if model is not None:
        extra = {"model": model, "max_model_len": V41_MAX_MODEL_LEN, "memory_gib": V41_MEMORY_GIB}
    core = EngineCore(
        EngineArgs(
            batch_invariant=invariant,
            num_threads=1,
            max_num_seqs=max(batch, 1),
            enable_prefix_caching=False,
            num_speculative_tokens=0,
            async_scheduling=False,
            **extra,
        )
    )
    budget = WARMUP_STEPS + steps + PROMPT_TOKENS
    for index in range(batch):
        prompt = [FIRST_ID + index + j for j in range(PROMPT_TOKENS)]
        core.add_request(str(index), prompt, SamplingParams(max_tokens=budget, ignore_eos=True))
    # Prefill (possibly over several steps) and a few decode steps before timing.
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in core.step() if o.new_token_ids)
    for _ in range(WARMUP_STEPS):
        core.step()
    walls, cpus = [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        core.step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    core.close()
    return {
        "wall_ms": statistics.median(walls) * 1e3,
        "cpu_ms": statistics.median(cpus) * 1e3,
        "load": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--v41", help="a random DeepSeek-V4.1 checkpoint of this preset")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        spec = json.loads(args.child)
        print(json.dumps(one_run(spec["model"], spec["invariant"], spec["batch"], args.steps)))
        return
    with tempfile.TemporaryDirectory() as directory:
        model = None
        if args.v41 is not None:
            from deepwell.engine.models.deepseek_v41.writer import PRESETS, write_tiny_checkpoint

            model = str(write_tiny_checkpoint(directory, text_config=PRESETS[args.v41]).path)
        figures = measure(args, model)
    if args.json is not None:
        args.json.write_text(json.dumps({"batches": figures}, indent=2))


def run_environment() -> dict[str, str]:
    """This process's environment, with the libraries capped at AVX2 where torch is."""
    environ = dict(os.environ)
    if environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() == "avx2":
        environ = AVX2_ENVIRONMENT | environ
    return environ


def measure(args: argparse.Namespace, model: str | None) -> dict[int, dict]:
    """Per batch size: the default's and the invariant path's median CPU ms a step, and
    their ratio."""
    environ = run_environment()
    levels = tuple(AVX2_ENVIRONMENT)
    print(" ".join(f"{name}={environ.get(name, '(unset)')}" for name in levels))
    summary = {}
    for batch in args.batch:
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.rounds):
            for invariant in (False, True):
                spec = json.dumps({"model": model, "invariant": invariant, "batch": batch})
                done = subprocess.run(
                    [sys.executable, __file__, "--steps", str(args.steps), "--child", spec],
                    check=True,
                    env=environ,
                    capture_output=True,
                    text=True,
                )
                runs[invariant].append(json.loads(done.stdout.strip().splitlines()[-1]))
        figures = {
            invariant: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
            for invariant, rs in runs.items()
        }
        default, invariant = figures[False], figures[True]
        print(
            f"batch {batch:3}: default {default['cpu_ms']:7.2f} ms CPU "
            f"({default['wall_ms']:7.2f} wall), invariant {invariant['cpu_ms']:7.2f} ms CPU "
            f"({invariant['wall_ms']:7.2f} wall): invariant/default "
            f"{invariant['cpu_ms'] / default['cpu_ms']:.2f}x CPU, "
            f"{invariant['wall_ms'] / default['wall_ms']:.2f}x wall "
            f"(load {default['load']:.1f} / {invariant['load']:.1f})"
        )
        summary[batch] = {
            "default_cpu_ms": default["cpu_ms"],
            "invariant_cpu_ms": invariant["cpu_ms"],
            "ratio": invariant["cpu_ms"] / default["cpu_ms"],
        }
    return summary


if __name__ == "__main__":
    main()
