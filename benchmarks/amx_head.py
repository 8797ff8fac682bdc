"""The bf16 head's float32 logits on AMX tiles (amx_linear.cpp, float32_out) against oneDNN's
packed bf16 linear, at decode's row counts on SmolLM2-135M's head (576 -> 49,152).

oneDNN's figure is a reference, not a candidate: its bf16 logits tie (layers/float32_head.py)
and its AMX sums change with the row count. As a decode step would, every call finds its
weight out of L1/L2: the candidates cycle through copies of the head as big together as
SmolLM2's layer linears (benchmarks/decode_linears.py), or through `--copies` (1: one head,
56.6 MB, which this Xeon's L3 keeps between calls). Per row count: the best of
`--repeats` interleaved rounds, thread CPU ms a call at one thread (wall ms at more, where
thread CPU time sees only the caller), and oneDNN / kernel (above 1: the kernel is faster).
Needs AMX tiles; says why not elsewhere.

    PYTHONPATH=. .venv/bin/python benchmarks/amx_head.py [--rows 1 8 16 32 48 64] [--threads 1] \
        [--copies N]
"""

import argparse
import os
import time
from collections.abc import Callable

import torch

from deepwell.engine.layers.amx_linear import amx_kernel_ready, amx_linear, tile_layout
from deepwell.engine.layers.decode_kernel import amx_tiles_lacking

IN_FEATURES, OUT_FEATURES = 576, 49152
# SmolLM2-135M's 30 layers of linears in bf16: what a decode step streams.
STREAMED_BYTES = 212e6


def seconds_per_call(fn: Callable[[], object], calls: int, clock: Callable[[], float]) -> float:
    fn()
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def measure(
    rows: int, copies: int, repeats: int, clock: Callable[[], float]
) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(rows)
    weights = [
        torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator).bfloat16()
        for _ in range(copies)
    ]
    tiles = [tile_layout(w) for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    x = torch.randn(rows, IN_FEATURES, generator=generator).bfloat16()
    turn = iter(range(1 << 62))

    def kernel():
        return amx_linear(x, tiles[next(turn) % copies], None, OUT_FEATURES, float32_out=True)

    def onednn():
        w = packed[next(turn) % copies]
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")

    # Whole passes over the copies, at least ~50 ms a round.
    calls = copies * max(1, int(0.05 / max(seconds_per_call(kernel, copies, clock), 1e-6) / copies))
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, fn in enumerate((kernel, onednn)):
            best[i] = min(best[i], seconds_per_call(fn, calls, clock))
    return best[0], best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 48, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--copies",
        type=int,
        default=max(1, round(STREAMED_BYTES / (2 * IN_FEATURES * OUT_FEATURES))),
        help="copies of the head the calls cycle through (default: a decode step's bytes)",
    )
    args = parser.parse_args()
    lacking = amx_tiles_lacking()
    if lacking is not None or not amx_kernel_ready():
        raise SystemExit(f"no AMX head here: {lacking or 'amx_linear.cpp did not build'}")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(
        f"head {IN_FEATURES} -> {OUT_FEATURES}, {args.copies} copies, {args.threads} threads, "
        f"load average {os.getloadavg()[0]:.2f}; "
        f"ms a call ({'thread CPU' if args.threads == 1 else 'wall'})"
    )
    with torch.no_grad():
        for rows in args.rows:
            kernel, onednn = measure(rows, args.copies, args.repeats, clock)
            print(
                f"{rows:3d} rows  kernel {kernel * 1e3:6.3f}  onednn bf16 {onednn * 1e3:6.3f}  "
                f"onednn / kernel {onednn / kernel:5.2f}"
            )


if __name__ == "__main__":
    main()
