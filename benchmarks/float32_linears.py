"""float32 linears of few rows: RowPaddedLinear (calls of 10-15 rows run as 16-row calls,
layers/float32_linear.py) against plain nn.Linear, on SmolLM2-135M's shapes, in one run.

Each shape and row count times both, interleaved, `--rounds` times, and keeps each one's
best thread CPU time per call (wall time with more than one thread); the ratio is plain over
padded (above 1: padding is faster). Run it as W runs, e.g. with AVX2 forced
(benchmarks/forced_avx2.py):

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 PYTHONPATH=. \\
        .venv/bin/python benchmarks/float32_linears.py [--threads 1] [--rounds 5]
"""

import argparse
import os
import time

import torch
from torch import nn

from deepwell.engine.layers.float32_linear import RowPaddedLinear

# SmolLM2-135M: qkv, o, gate_up, down, and the tied head.
SHAPES = ((576, 832), (576, 576), (576, 3072), (1536, 576), (576, 49152))
ROWS = (1, 4, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24)


def seconds_per_call(linear: nn.Module, x: torch.Tensor, calls: int, threads: int) -> float:
    clock = time.thread_time if threads == 1 else time.perf_counter
    start = clock()
    for _ in range(calls):
        linear(x)
    return (clock() - start) / calls


def compare(in_features: int, out_features: int, rows: int, args) -> tuple[float, float]:
    torch.manual_seed(0)
    plain = nn.Linear(in_features, out_features, bias=False)
    padded = nn.Linear(in_features, out_features, bias=False)
    padded.load_state_dict(plain.state_dict())
    padded.__class__ = RowPaddedLinear
    x = torch.randn(rows, in_features)
    # About 20 ms of work per timing at the padded size.
    calls = max(2, int(1.5e9 / (max(rows, 16) * in_features * out_features * 2) / 20))
    best = [float("inf"), float("inf")]
    with torch.no_grad():
        for _ in range(args.rounds):
            for i, linear in enumerate((plain, padded)):
                best[i] = min(best[i], seconds_per_call(linear, x, calls, args.threads))
    return best[0], best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch at {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, "
        f"load average {os.getloadavg()[0]:.1f}; ms per call plain / padded (ratio)"
    )
    for in_features, out_features in SHAPES:
        cells = []
        for rows in ROWS:
            plain, padded = compare(in_features, out_features, rows, args)
            cells.append(f"{rows}: {plain * 1e3:.2f}/{padded * 1e3:.2f} ({plain / padded:.2f})")
        print(f"{in_features} -> {out_features}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
