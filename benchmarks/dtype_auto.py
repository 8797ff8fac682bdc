"""`--dtype auto` against `--dtype float32` (and bfloat16) on workload W: what auto picks on
this CPU, and whether it runs at the speed of the dtype it picked (issue 16: on a CPU without
native bf16 the default must be float32 and within 10% of `--dtype float32`).

Each configuration runs W (or its first `--requests`) through deepwell's `LLM.generate` in a
fresh process, speculation off, greedy, EOS ignored; rounds alternate the configurations and
each keeps its fastest. A configuration that takes longer than `--timeout` is reported as
not done (bf16 without native support can take tens of minutes).

On a CPU with native bf16, an AVX2-only one can be imitated (root; torch's and oneDNN's
kernels limited to AVX2, MKL's too (benchmarks/forced_avx2.py), /proc/cpuinfo without the
AVX-512 and AMX flags, so `auto` sees what it would see there):

    sed -E '/^flags/ s/ (avx512[a-z0-9_]*|amx[a-z0-9_]*|avx_vnni)//g' /proc/cpuinfo > /tmp/cpuinfo
    unshare -m sh -c 'mount --bind /tmp/cpuinfo /proc/cpuinfo && \\
        ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python benchmarks/dtype_auto.py --threads 2'

    .venv/bin/python benchmarks/dtype_auto.py [--threads N] [--requests 64] [--rounds 2]
        [--dtypes auto,float32,bfloat16] [--timeout 900]
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from throughput_vs_hf import load_workload

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> dict:
    import torch

    from deepwell.cpu_dtype import select_dtype
    from deepwell.engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    workload = load_workload()[0][: args.requests]
    llm = LLM(
        dtype=args.dtype,
        enable_prefix_caching=False,
        num_speculative_tokens=0,
        num_threads=args.threads,
        decode_sequence=False,
    )
    greedy = {"temperature": 0, "ignore_eos": True}
    llm.generate(
        prompt_token_ids=[workload[0]["prompt_ids"][:64]],
        sampling_params=SamplingParams(max_tokens=8, **greedy),
        use_tqdm=False,
    )
    params = [SamplingParams(max_tokens=r["output_len"], **greedy) for r in workload]
    start = time.perf_counter()
    llm.generate(
        prompt_token_ids=[r["prompt_ids"] for r in workload], sampling_params=params, use_tqdm=False
    )
    seconds = time.perf_counter() - start
    choice = select_dtype(args.dtype)
    return {"seconds": seconds, "dtype": choice.dtype, "reason": choice.reason}


def run_child(args, dtype: str) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        *("--dtype", dtype, "--threads", str(args.threads), "--requests", str(args.requests)),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    try:
        result = subprocess.run(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"not done in {args.timeout:.0f} s"}
    if result.returncode:
        return {"error": f"exit {result.returncode}"}
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--requests", type=int, default=64, help="W's first N requests")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds, fastest kept")
    parser.add_argument(
        "--dtypes",
        type=lambda text: text.split(","),
        default=["auto", "float32", "bfloat16"],
        help="--dtype values to run (comma-separated)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return

    workload = load_workload()[0][: args.requests]
    tokens = sum(r["output_len"] for r in workload)
    print(
        f"W's first {len(workload)} requests ({tokens} output tokens), {args.threads} threads,"
        f" ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '-')},"
        f" ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')};"
        f" load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    best: dict[str, dict] = {}
    for index in range(args.rounds):
        for dtype in args.dtypes:
            if "error" in best.get(dtype, {}):
                continue  # a configuration that timed out is not run again
            result = run_child(args, dtype)
            if "error" in result:
                print(f"round {index + 1}: --dtype {dtype}: {result['error']}", flush=True)
                best[dtype] = result
                continue
            rate = tokens / result["seconds"]
            print(
                f"round {index + 1}: --dtype {dtype} ran {result['dtype']} ({result['reason']}):"
                f" {result['seconds']:.1f} s, {rate:.1f} output tok/s"
                f" (load average {os.getloadavg()[0]:.2f})",
                flush=True,
            )
            if dtype not in best or result["seconds"] < best[dtype]["seconds"]:
                best[dtype] = result
    auto = best.get("auto")
    if not auto or "error" in auto:
        return
    print(f"auto picked {auto['dtype']}")
    for dtype, result in best.items():
        if dtype != "auto" and "error" not in result:
            print(f"throughput auto / --dtype {dtype}: {result['seconds'] / auto['seconds']:.2f}")


if __name__ == "__main__":
    main()
