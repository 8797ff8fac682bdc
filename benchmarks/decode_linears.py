"""Decode-shaped bf16 linears: the panel kernel (layers/bf16_gemm.cpp) against oneDNN's packed
linear (what PackedLinear ran before) and F.linear, on the same bf16 weights, same run.

A decode step streams each weight from memory once: every candidate cycles through copies of
its weight as big together as SmolLM2's layer linears (212 MB), so no call finds its weight
in cache. Per shape and row count: thread CPU µs a call (one thread) or wall µs (two threads, where
thread CPU time sees only the caller), the best of `--repeats` interleaved rounds, the
kernel's GFLOP/s, and the ratio oneDNN / kernel (above 1: the kernel is faster). The head
row times the float32 logits: oneDNN's bf16 result and its `.float()` against the kernel's
widened store.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_linears.py [--threads 1 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepwell.engine.layers.bf16_gemm import panel_kernel_ready, panel_layout, panel_linear

# SmolLM2-135M's (in, out): qkv, o, gate_up, down, the head; and a 1,728-output qkv-like one.
SHAPES = {
    "qkv": (576, 960),
    "qkv-like": (576, 1728),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "head": (576, 49152),
}
ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 51, 64)
# SmolLM2-135M's 30 layers of linears in bf16: what a decode step streams.
STREAMED_BYTES = 212e6


def best_seconds(fn: Callable[[], object], calls: int, clock: Callable[[], float]) -> float:
    fn()
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def measure(name: str, rows: int, repeats: int, clock: Callable[[], float]) -> str:
    in_features, out_features = SHAPES[name]
    copies = max(1, round(STREAMED_BYTES / (2 * in_features * out_features)))
    weights = [torch.randn(out_features, in_features).to(torch.bfloat16) for _ in range(copies)]
    onednn_weights = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    panels = [panel_layout(w) for w in weights]
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    head = name == "head"
    turn = iter(range(1 << 62))

    def onednn():
        w = onednn_weights[next(turn) % copies]
        out = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")
        return out.float() if head else out

    def f_linear():
        out = F.linear(x, weights[next(turn) % copies])
        return out.float() if head else out

    def kernel():
        return panel_linear(x, panels[next(turn) % copies], None, out_features, widen=head)

    candidates = {"onednn": onednn, "f.linear": f_linear, "kernel": kernel}
    # Whole passes over the copies, at least ~20 ms a round at the kernel's speed.
    flops = 2 * rows * in_features * out_features
    calls = max(copies, int(0.02 / max(best_seconds(kernel, copies, clock), 1e-6)))
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(repeats):
        for label, fn in candidates.items():
            best[label] = min(best[label], best_seconds(fn, calls, clock))
    us = {label: seconds * 1e6 for label, seconds in best.items()}
    return (
        f"{name:9s} {rows:3d} rows  onednn {us['onednn']:9.1f} µs  f.linear {us['f.linear']:9.1f}"
        f"  kernel {us['kernel']:9.1f} ({flops / best['kernel'] / 1e9:6.1f} GFLOP/s, onednn at "
        f"{flops / best['onednn'] / 1e9:6.1f})  onednn/kernel {best['onednn'] / best['kernel']:5.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not panel_kernel_ready():
        raise SystemExit("the panel kernel needs AVX512_BF16 (and an AVX-512 build)")
    torch.manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        clock = time.thread_time if threads == 1 else time.perf_counter
        print(f"# {threads} thread(s), {'thread CPU' if threads == 1 else 'wall'} time")
        for name in args.shapes:
            for rows in args.rows:
                print(measure(name, rows, args.repeats, clock), flush=True)


if __name__ == "__main__":
    main()
