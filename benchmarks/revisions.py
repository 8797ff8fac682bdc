"""deepwell at two git revisions on workload W, each round in fresh processes, alternating.

Checks that a change to the engine does not cost throughput on the embedded model: the
base revision is checked out in a temporary worktree and both run W (64 requests, 64–512
prompt and 64–256 output tokens, benchmarks/workload.py) in `--dtype` (bf16) with prefix
caching off, one after the other, for `--rounds` rounds; each keeps its fastest (this 2-core box
drifts by ~10% over minutes, for both alike). Prints `throughput ratio (head/base): X`.

    .venv/bin/python benchmarks/revisions.py --base REV [--head REV] [--rounds 3] [--threads N]
        [--dtype float32]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# This checkout's W: a base revision may predate benchmarks/workload.py.
WORKLOAD = ROOT / "benchmarks" / "workload.py"

# Runs in the child, with the revision's checkout first on sys.path.
CHILD = """
import importlib.util, json, sys, time
import torch
if {threads}:
    torch.set_num_threads({threads})
spec = importlib.util.spec_from_file_location("workload", {workload!r})
workload = importlib.util.module_from_spec(spec)
spec.loader.exec_module(workload)
requests = workload.make_workload()
import deepwell
assert deepwell.__file__.startswith({checkout!r}), deepwell.__file__
from deepwell.engine import LLM, SamplingParams
llm = LLM(dtype={dtype!r}, enable_prefix_caching=False, decode_sequence=False)
greedy = dict(temperature=0, ignore_eos=True)
llm.generate(prompt_token_ids=[requests[0]["prompt_ids"][:64]],
             sampling_params=SamplingParams(max_tokens=8, **greedy), use_tqdm=False)
params = [SamplingParams(max_tokens=r["output_len"], **greedy) for r in requests]
start = time.perf_counter()
llm.generate(prompt_token_ids=[r["prompt_ids"] for r in requests], sampling_params=params,
             use_tqdm=False)
print(json.dumps({{"seconds": time.perf_counter() - start,
                   "output_tokens": sum(r["output_len"] for r in requests)}}))
"""


def run_revision(checkout: Path, threads: int, dtype: str) -> dict:
    code = CHILD.format(
        threads=threads, workload=str(WORKLOAD), checkout=str(checkout), dtype=dtype
    )
    env = dict(os.environ, PYTHONPATH=str(checkout))
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode:
        sys.exit(f"the run in {checkout} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def checkout(revision: str, directory: Path) -> Path:
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(directory), revision],
        check=True,
        capture_output=True,
    )
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare against")
    parser.add_argument("--head", help="the revision measured (default: this checkout as is)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", default="bfloat16", help="the engines' --dtype")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        checkouts = {"base": checkout(args.base, Path(scratch) / "base")}
        checkouts["head"] = checkout(args.head, Path(scratch) / "head") if args.head else ROOT
        try:
            best: dict[str, float] = {}
            for index in range(args.rounds):
                for name, path in checkouts.items():
                    print(f"round {index + 1}/{args.rounds}: {name} …", flush=True)
                    result = run_revision(path, args.threads, args.dtype)
                    tok_s = result["output_tokens"] / result["seconds"]
                    print(
                        f"{name}: {result['seconds']:.1f} s, {tok_s:.1f} output tok/s", flush=True
                    )
                    best[name] = max(best.get(name, 0.0), tok_s)
        finally:
            for path in checkouts.values():
                if path != ROOT:
                    subprocess.run(
                        ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                        check=False,
                    )
    for name, tok_s in best.items():
        print(f"{name} (fastest of {args.rounds}): {tok_s:.1f} output tok/s")
    print(f"throughput ratio (head/base): {best['head'] / best['base']:.3f}")


if __name__ == "__main__":
    main()
