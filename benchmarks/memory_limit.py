"""Batch-1 decode against the memory limit: (bytes of weights read per token x tok/s) over the
machine's read bandwidth, for deepwell (bf16 and int4) and llama.cpp's tg128 on the same GGUF.

The bandwidth is a STREAM-like read: a torch sum over a float32 tensor of `--gib` GiB (far
past every cache) with the engines' thread count, the best of `--repeats` after one to fault
the pages in, probed before and after the engines (the larger kept). Bytes a token: deepwell's, every linear's weight as the decode step reads it
(int4: the kernel's GGUF-block layout, scales included; bf16: the packed or plain weight),
the output head once; llama.cpp's, every tensor of the GGUF (its tied embedding is its head).
The embedding row, norms and the KV cache (a few MB at these lengths) are left out of both.
deepwell's decode tok/s: `LLM.generate` of a 64-token prompt (W's first), speculation off,
greedy, EOS ignored: (time of n + 1 tokens - time of 1) / n, the mean of `--repetitions`.
Each measurement runs in its own process. Issue 33's goal: >= 85 % of the limit, on
AVX-512 and with AVX2 forced: `--force-avx2` runs deepwell's processes with torch's,
oneDNN's, MKL's and deepwell's own kernels at AVX2 (benchmarks/forced_avx2.py; llama.cpp
keeps its build's).
Each deepwell row names the instruction sets it ran: torch's dispatch level and the int4
kernel's path.

    PYTHONPATH=. .venv/bin/python benchmarks/memory_limit.py [--threads 2] [--gib 1]
        [--quantizations none,int4] [--tokens 128] [--repetitions 3] [--force-avx2]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import llama_cpp_peer as llama_cpp
from forced_avx2 import AVX2_ENVIRONMENT
from workload import make_workload

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 64
GOAL_FRACTION = 0.85


@dataclass(frozen=True)
class DecodeAtLimit:
    """One engine's batch-1 decode as a share of the memory limit."""

    engine: str
    tok_s: float
    weight_bytes: int
    bandwidth_bytes_s: float
    # torch's dispatch level and the int4 kernel's path, for deepwell's rows.
    instruction_sets: str = ""

    @property
    def fraction(self) -> float:
        return self.weight_bytes * self.tok_s / self.bandwidth_bytes_s


# ---- children: each prints one JSON line ----


def read_bandwidth(threads: int, gib: float, repeats: int) -> float:
    """Bytes a second a sum over `gib` GiB of float32 reads, the best of `repeats`."""
    import torch

    torch.set_num_threads(threads)
    values = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    values.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        values.sum()
        best = min(best, time.perf_counter() - start)
    return values.numel() * 4 / best


def decode_weight_bytes(model) -> int:
    """Bytes of linear weights one batch-1 decode step reads, each tensor once (the tied
    head shares the embedding's weight in bf16; in int4 it has its own Q8_0 blocks)."""
    from torch import nn

    seen, total = set(), 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        # The copy a call reads: GGUF blocks, AMX tiles, oneDNN's packed weight, or the plain
        # weight.
        names = ("quant_weight", "tiles", "packed_weight")
        read = next((t for n in names if (t := getattr(module, n, None)) is not None), None)
        if read is None:
            read = module.weight
        # By identity: a tied head is the embedding's Parameter, and oneDNN's packed
        # weights have no storage whose address could be compared.
        if id(read) not in seen:
            seen.add(id(read))
            total += read.numel() * read.element_size()
    return total


def deepwell_decode(threads: int, quantization: str, tokens: int, repetitions: int) -> dict:
    import torch

    from deepwell.engine import LLM, SamplingParams
    from deepwell.engine.layers.decode_kernel import load_quant_kernel

    torch.set_num_threads(threads)
    llm = LLM(
        enable_prefix_caching=False,
        num_speculative_tokens=0,
        quantization=quantization,
        num_threads=threads,
        decode_sequence=False,
    )
    prompt = make_workload()[0]["prompt_ids"][:PROMPT_TOKENS]

    def timed(count: int) -> float:
        params = SamplingParams(max_tokens=count, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
        return time.perf_counter() - start

    timed(8)
    rates = []
    for _ in range(repetitions):
        first = timed(1)
        rates.append(tokens / (timed(tokens + 1) - first))
    kernel = load_quant_kernel().module
    path = kernel.instruction_set() if kernel is not None else "unavailable"
    return {
        "tok_s": statistics.fmean(rates),
        "weight_bytes": decode_weight_bytes(llm.core.runner.model),
        "instruction_sets": f"torch {torch.backends.cpu.get_cpu_capability()}, int4 kernel {path}",
    }


def gguf_bytes(path: Path) -> int:
    """Bytes of every tensor in a GGUF file, as stored."""
    from gguf import GGUFReader

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(path).tensors)


def run_child(args, *child: str) -> dict:
    command = [sys.executable, __file__, "--threads", str(args.threads), "--child", *child]
    command += ["--gib", str(args.gib), "--repeats", str(args.repeats)]
    command += ["--tokens", str(args.tokens), "--repetitions", str(args.repetitions)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    if args.force_avx2:
        env.update(AVX2_ENVIRONMENT)
    result = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    if result.returncode:
        sys.exit(f"{' '.join(child)} failed (exit {result.returncode})")
    return json.loads(result.stdout.splitlines()[-1])


def child_main(args) -> None:
    kind, *rest = args.child
    if kind == "bandwidth":
        result = {"bandwidth_bytes_s": read_bandwidth(args.threads, args.gib, args.repeats)}
    else:
        result = deepwell_decode(args.threads, rest[0], args.tokens, args.repetitions)
    print(json.dumps(result), flush=True)


# ---- parent ----


def verdict(row: DecodeAtLimit) -> str:
    goal = "met" if row.fraction >= GOAL_FRACTION else "missed"
    return (
        f"memory-limit fraction, {row.engine}: {row.fraction:.2f}"
        f" (goal >= {GOAL_FRACTION:.0%}: {goal})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="every engine's")
    parser.add_argument("--gib", type=float, default=1.0, help="the bandwidth probe's size")
    parser.add_argument("--repeats", type=int, default=5, help="bandwidth reads; best kept")
    parser.add_argument(
        "--quantizations",
        type=lambda text: text.split(","),
        default=["none", "int4"],
        help="deepwell's --quantization values (comma-separated)",
    )
    parser.add_argument("--tokens", type=int, default=128, help="decode steps per run")
    parser.add_argument("--repetitions", type=int, default=3, help="decode runs, averaged")
    parser.add_argument(
        "--no-llama-cpp", dest="llama_cpp", action="store_false", help="deepwell only"
    )
    parser.add_argument(
        "--llama-cpp-cache", type=Path, default=llama_cpp.CACHE_DIR, help="llama.cpp's build"
    )
    parser.add_argument(
        "--force-avx2",
        action="store_true",
        help="deepwell's processes (and the bandwidth probe) at AVX2: "
        + " ".join(f"{k}={v}" for k, v in AVX2_ENVIRONMENT.items()),
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.gib < 1 and not args.child:
        print(f"(a {args.gib:g} GiB probe may read from the caches: not STREAM-like)")
    if args.child:
        child_main(args)
        return

    llama = llama_cpp.find_llama_cpp(args.llama_cpp_cache) if args.llama_cpp else None
    if args.llama_cpp and llama is None:
        sys.exit(f"{llama_cpp.missing_build(args.llama_cpp_cache)}, or pass --no-llama-cpp")
    print(
        f"{args.threads} threads{', AVX2 forced' if args.force_avx2 else ''}; SIMD flags: {' '.join(llama_cpp.simd_flags())};"
        f" load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    # Probed before and after the engines, the larger kept: a busy moment under one probe
    # does not flatter every engine's share.
    before = run_child(args, "bandwidth")["bandwidth_bytes_s"]
    measured = {}
    for quantization in args.quantizations:
        measured[quantization] = run_child(args, "deepwell", quantization)
    if llama is not None:
        tg128 = llama_cpp.tg128(llama, args.threads)
    after = run_child(args, "bandwidth")["bandwidth_bytes_s"]
    bandwidth = max(before, after)
    print(
        f"read bandwidth ({args.gib:g} GiB sum, best of {args.repeats}): before"
        f" {before / 1e9:.1f}, after {after / 1e9:.1f} GB/s"
    )
    rows = []
    for quantization, figures in measured.items():
        engine = f"deepwell {'bf16' if quantization == 'none' else quantization}"
        rows.append(
            DecodeAtLimit(
                engine,
                figures["tok_s"],
                figures["weight_bytes"],
                bandwidth,
                figures["instruction_sets"],
            )
        )
    if llama is not None:
        weight = gguf_bytes(llama_cpp.model_path())
        rows.append(DecodeAtLimit("llama.cpp tg128", tg128.tok_s, weight, bandwidth))
    print(f"load average {os.getloadavg()[0]:.2f}")
    for row in rows:
        print(
            f"  {row.engine:16s} {row.tok_s:7.1f} tok/s x {row.weight_bytes / 1e6:6.1f} MB"
            f" = {row.tok_s * row.weight_bytes / 1e9:5.1f} GB/s"
            + (f"  ({row.instruction_sets})" if row.instruction_sets else "")
        )
    for row in rows:
        print(verdict(row))
    llama_row = next((row for row in rows if row.engine.startswith("llama.cpp")), None)
    if llama_row is not None:
        for row in rows:
            if row is not llama_row:
                ratio = row.tok_s / llama_row.tok_s
                print(f"batch-1 decode ratio, {row.engine} / llama.cpp tg128: {ratio:.2f}")
    if args.json:
        summary = {
            "threads": args.threads,
            "force_avx2": args.force_avx2,
            "simd_flags": llama_cpp.simd_flags(),
            "bandwidth_bytes_s": bandwidth,
            "bandwidth_before_after_bytes_s": [before, after],
            "rows": [asdict(row) | {"fraction": row.fraction} for row in rows],
        }
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
