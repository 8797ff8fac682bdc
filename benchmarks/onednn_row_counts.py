"""What a linear's row count costs and changes on CPU: the first call at a new row count
against a repeat of it (oneDNN creates, JITs, a primitive for each new input shape and
caches it; MKL's float32 sgemm has no such step), and whether a row's bf16 result depends on
how many rows share its call (what splitting or padding calls to a few row counts would
change).

Shapes are SmolLM2-135M's projections (qkv, o, gate_up, down) and its head, packed for
oneDNN as the engine packs them where oneDNN runs them (layers/packed_linear.py; on AMX the
engine runs amx_linear.cpp instead). Thread CPU time, one thread by default.

    PYTHONPATH=. .venv/bin/python benchmarks/onednn_row_counts.py [--counts 60]
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 ...   # oneDNN below AMX, as on an EPYC
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.layers.bf16_gemm import onednn_uses_amx

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))
# W's row counts that reach oneDNN: decode steps' (panels take them without AMX), the
# budget-filled prefill and mixed steps' 1,024, and others for the bits.
BIT_COUNTS = (2, 16, 32, 63, 64, 65, 128, 222, 256, 512, 600, 700, 900, 1024, 1100)


def onednn_call(weight: torch.Tensor):
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [None], "")


def thread_seconds(call, x: torch.Tensor) -> float:
    start = time.thread_time()
    call(x)
    return time.thread_time() - start


def first_against_repeat(call, fan_in: int, counts: list[int]) -> tuple[float, float]:
    """Thread CPU of each count's first call and of a repeat right after it, summed."""
    first = repeat = 0.0
    for count in counts:
        x = torch.randn(count, fan_in).to(torch.bfloat16)
        first += thread_seconds(call, x)
        repeat += thread_seconds(call, x)
    return first, repeat


def float32_first_against_repeat(fan_in: int, fan_out: int, counts: list[int]):
    weight = torch.randn(fan_out, fan_in) * fan_in**-0.5
    return first_against_repeat(lambda x: F.linear(x.float(), weight), fan_in, counts)


def rows_that_change(call, fan_in: int) -> list[str]:
    """Row counts whose rows differ from the same rows computed in a call of the most rows,
    with how many of their elements differ."""
    x = (torch.randn(max(BIT_COUNTS), fan_in) * 0.05).to(torch.bfloat16)
    reference = call(x)
    changed = []
    for count in BIT_COUNTS:
        differ = (call(x[:count].contiguous()) != reference[:count]).sum().item()
        if differ:
            changed.append(f"{count} ({differ})")
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--counts", type=int, default=60, help="new row counts, 100-700")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    counts = random.Random(0).sample(range(100, 700), args.counts)
    print(
        f"{args.threads} threads, oneDNN AMX {onednn_uses_amx()}, load average "
        f"{os.getloadavg()[0]:.1f}; {args.counts} new row counts in 100-700"
    )
    model = nn.Sequential(*(nn.Linear(i, o, bias=False) for i, o in SHAPES)).to(torch.bfloat16)
    for (fan_in, fan_out), linear in zip(SHAPES, model, strict=True):
        call = onednn_call(torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None))
        first, repeat = first_against_repeat(call, fan_in, counts)
        first32, repeat32 = float32_first_against_repeat(fan_in, fan_out, counts)
        changed = rows_that_change(call, fan_in)
        print(
            f"{fan_in}->{fan_out}: bf16 oneDNN first {first:.3f} s, repeat {repeat:.3f} s "
            f"({first / repeat:.2f}x, {(first - repeat) / len(counts) * 1e3:.2f} ms a count); "
            f"float32 first {first32:.3f} s, repeat {repeat32:.3f} s ({first32 / repeat32:.2f}x)"
        )
        print(
            f"  rows whose bits change against a {max(BIT_COUNTS)}-row call: "
            + (", ".join(changed) if changed else "none")
            + f" of {len(BIT_COUNTS)} counts"
        )


if __name__ == "__main__":
    main()
