"""DeepSeek-V4.1 weights as released (packed) against the bf16-expanded reference path.

Each configuration loads in its own process, so its peak resident memory is its own: load
time, peak RSS (VmHWM / ru_maxrss) against the checkpoint's bytes on disk, and greedy
decode throughput at batch 1 and 16 (decode = the time of N output tokens less that of one,
so prefill is left out), and the process's CPU seconds a decoded token (all threads: on a
shared machine it moves less with the other load than wall time does). On a VM even CPU time
is not steady (the host's other tenants slow the vCPU itself: a fixed pure-Python loop took
from 137 to 272 ms within minutes), so each timing is bracketed by that loop (the host
probe) and the CPU time a token is also given in probe units, comparable across runs.
Prints one table and the packed/expanded ratios:

    .venv/bin/python benchmarks/v41_scale.py [--model DIR | --preset medium]
        [--batch-sizes 1 16] [--output-len 32] [--prompt-len 32] [--threads 2]

Goals (issue "engine IX", on the medium checkpoint): packed peak RSS <= 1.15x the bytes on
disk + 700 MiB; packed batch-1 decode >= 1.5x the expanded path.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {"packed": False, "expanded": True}  # name → expand_weights
# Enough for the longest sequence of a run: the KV budget beside the weights stays small.
MAX_MODEL_LEN = 256
FIRST_TEXT_ID = 17
# The host probe's work: a pure-Python loop (no memory traffic, no torch) of this many steps.
PROBE_STEPS = 1_000_000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a V4.1 checkpoint directory (default: write --preset)")
    parser.add_argument("--preset", default="medium", help="tiny-checkpoint preset to write")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--worker", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args, CONFIGS[args.worker])))
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or write(args.preset, Path(scratch) / args.preset)
        disk = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
        results = {}
        for name in args.configs:
            command = [sys.executable, __file__, "--worker", name, "--model", model]
            command += ["--batch-sizes", *map(str, args.batch_sizes)]
            command += ["--output-len", str(args.output_len), "--prompt-len", str(args.prompt_len)]
            if args.threads:
                command += ["--threads", str(args.threads)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    report(results, disk, args.batch_sizes)
    return 0


def write(preset: str, directory: Path) -> str:
    from deepwell.engine.models.deepseek_v41.writer import (
        DRAWN_STORED_PRESETS,
        PRESETS,
        write_tiny_checkpoint,
    )

    started = time.monotonic()
    written = write_tiny_checkpoint(
        directory,
        text_config=PRESETS[preset],
        keep_weights=False,
        draw_stored=preset in DRAWN_STORED_PRESETS,
    )
    print(f"wrote the {preset} checkpoint in {time.monotonic() - started:.1f} s", flush=True)
    return str(written.path)


def measure(args: argparse.Namespace, expand: bool) -> dict:
    """One configuration, in this (fresh) process."""
    from deepwell.engine import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(
        model=args.model,
        expand_weights=expand,
        max_model_len=MAX_MODEL_LEN,
        memory_gib=memory_gib(args.model, expand),
        num_speculative_tokens=0,
        enable_prefix_caching=False,
        max_num_seqs=max(args.batch_sizes),
        num_threads=args.threads,
        decode_sequence=False,
    )
    load_s = time.monotonic() - started
    vocab = llm.core.model_config.vocab_size
    prompt = [FIRST_TEXT_ID + i % (vocab - FIRST_TEXT_ID - 16) for i in range(args.prompt_len)]
    decode = {}
    decode_cpu_ms = {}
    probe_ms = {}
    tokens = {}
    for batch in args.batch_sizes:
        prompts = [
            prompt[batch_index % len(prompt) :] + prompt[: batch_index % len(prompt)]
            for batch_index in range(batch)
        ]
        # A first call pays one-time costs (the kernels' load, the mapped weights' first
        # page faults), which would otherwise land on the 1-token timing alone.
        warmup = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        llm.generate(prompt_token_ids=prompts, sampling_params=warmup, use_tqdm=False)
        timings = {}
        cpu = {}
        probes = [host_probe_ms()]
        for output_len in (1, args.output_len):
            params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
            started, cpu_started = time.monotonic(), time.process_time()
            outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            timings[output_len] = time.monotonic() - started
            cpu[output_len] = time.process_time() - cpu_started
            probes.append(host_probe_ms())
        decoded = batch * (args.output_len - 1)
        decode[batch] = decoded / (timings[args.output_len] - timings[1])
        decode_cpu_ms[batch] = 1000 * (cpu[args.output_len] - cpu[1]) / decoded
        probe_ms[batch] = sum(probes) / len(probes)
        tokens[batch] = [output.token_ids for output in outputs]
    return {
        "load_s": load_s,
        "peak_rss_bytes": peak_rss_bytes(),
        "decode_tok_s": decode,
        "decode_cpu_ms": decode_cpu_ms,
        "probe_ms": probe_ms,
        "tokens": tokens,
    }


def memory_gib(model: str, expand: bool) -> float:
    """The engine's budget (weights + KV): the weights as held, plus 0.25 GiB of KV."""
    disk = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    # Expanded: MXFP4 (~0.53 bytes a weight) to bf16, and a oneDNN-packed copy beside it.
    held = disk * (8 if expand else 1)
    return held / 2**30 + 0.25


def host_probe_ms() -> float:
    """CPU ms of PROBE_STEPS steps of a pure-Python loop: how fast the vCPU runs just now."""
    started = time.process_time()
    total = 0
    for step in range(PROBE_STEPS):
        total += step
    return 1000 * (time.process_time() - started)


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def report(results: dict, disk: int, batch_sizes: list[int]) -> None:
    gib = 2**30
    print(f"checkpoint on disk: {disk / gib:.3f} GiB")
    header = f"{'config':<10}{'load s':>9}{'peak RSS GiB':>14}{'RSS/disk':>10}"
    header += "".join(f"{f'decode b{b} tok/s':>19}" for b in batch_sizes)
    header += "".join(f"{f'b{b} CPU ms/tok':>16}" for b in batch_sizes)
    header += "".join(f"{f'b{b} probe ms':>14}" for b in batch_sizes)
    print(header)
    for name, r in results.items():
        line = f"{name:<10}{r['load_s']:>9.1f}{r['peak_rss_bytes'] / gib:>14.3f}"
        line += f"{r['peak_rss_bytes'] / disk:>10.2f}"
        line += "".join(f"{r['decode_tok_s'][str(b)]:>19.2f}" for b in batch_sizes)
        line += "".join(f"{r['decode_cpu_ms'][str(b)]:>16.2f}" for b in batch_sizes)
        line += "".join(f"{r['probe_ms'][str(b)]:>14.1f}" for b in batch_sizes)
        print(line)
    if {"packed", "expanded"} <= results.keys():
        packed, expanded = results["packed"], results["expanded"]
        bound = 1.15 * disk + 700 * 2**20
        print(
            f"packed peak RSS {packed['peak_rss_bytes'] / gib:.3f} GiB vs bound 1.15 x disk + "
            f"700 MiB = {bound / gib:.3f} GiB: {'within' if packed['peak_rss_bytes'] <= bound else 'OVER'}"
        )
        print(
            f"peak RSS expanded / packed: {expanded['peak_rss_bytes'] / packed['peak_rss_bytes']:.2f}x"
        )
        print(f"load time expanded / packed: {expanded['load_s'] / packed['load_s']:.2f}x")
        for b in batch_sizes:
            ratio = packed["decode_tok_s"][str(b)] / expanded["decode_tok_s"][str(b)]
            cpu_ratio = expanded["decode_cpu_ms"][str(b)] / packed["decode_cpu_ms"][str(b)]
            probe_ratio = cpu_ratio * packed["probe_ms"][str(b)] / expanded["probe_ms"][str(b)]
            same = packed["tokens"][str(b)] == expanded["tokens"][str(b)]
            print(
                f"decode batch {b}: packed / expanded {ratio:.2f}x (CPU time a token: "
                f"{cpu_ratio:.2f}x; in host-probe units: {probe_ratio:.2f}x); same tokens: {same}"
            )


if __name__ == "__main__":
    sys.exit(main())
