"""A lone row through the batch-invariant mode's float32 linears (blockscaled.cpp's
`f32_linear`) against MKL's (F.linear) and a plain read of the same bytes, over a
SmolLM2-135M decode step's weights: 30 layers' qkv, o, gate_up and down, then the head.

Batch-1 float32 decode streams every weight once, so each figure is also given in GB/s.
Random weights, one copy per layer (425 MB, past the caches); each part timed `--rounds`
times, the three interleaved, the median kept: thread CPU time with one thread, wall time
with more. Compare two trees by running it from each, alternating:

    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 PYTHONPATH=. \\
        .venv/bin/python benchmarks/rowwise_lone_row.py [--threads 1] [--rounds 7]
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepwell.engine.layers.blockscaled import native_kernel

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
# (out, in) of one layer's linears: qkv, o, gate_up, down.
LAYER_SHAPES = ((960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))


def milliseconds(
    call: Callable[[torch.Tensor, torch.Tensor], object], weights, inputs, clock
) -> float:
    """One pass of `call(x, w)` over `weights`, x the row of w's width."""
    start = clock()
    for w in weights:
        call(inputs[w.shape[1]], w)
    return (clock() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = native_kernel()
    if kernel is None:
        raise SystemExit("blockscaled.cpp did not build: nothing to measure")
    torch.manual_seed(0)
    layers = [[torch.randn(shape) for shape in LAYER_SHAPES] for _ in range(LAYERS)]
    head = torch.randn(VOCAB, HIDDEN)
    inputs = {width: torch.randn(1, width) for width in (HIDDEN, INTERMEDIATE)}
    parts = {"layers": [w for layer in layers for w in layer], "head": [head]}
    calls = {
        "f32_linear": kernel.f32_linear,
        "F.linear (MKL)": F.linear,
        "read (sum)": lambda x, w: w.sum(),
    }
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"torch {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s)")
    for name, weights in parts.items():
        size = sum(w.numel() * 4 for w in weights)
        figures = {label: [] for label in calls}
        for _ in range(args.rounds):
            for label, call in calls.items():
                figures[label].append(milliseconds(call, weights, inputs, clock))
        line = ", ".join(
            f"{label} {statistics.median(ms):6.2f} ms ({size / statistics.median(ms) / 1e6:4.1f} GB/s)"
            for label, ms in figures.items()
        )
        print(f"{name:6} ({size / 1e6:3.0f} MB): {line}")


if __name__ == "__main__":
    main()
