"""The block-scaled kernels (layers/blockscaled.py, blockscaled.cpp) against the bf16 path
the engine runs today, in the same process, at decode row counts.

- FP8 linears [out x in] = 2048x2048 and 4096x2048: `fp8_block_linear` on the released
  float8_e4m3fn + e8m0 blocks against F.linear on bf16 weights holding the dequantised values
  (x in bf16, as the engine computes).
- The output head kept in bf16, a 32768-row slice of it (the release's is 129,280 × 4096):
  `bf16_linear` against F.linear (bf16 out, as the engine's head).
- Routed experts, hidden 2048, intermediate 768 (and 1536), 64 experts, top-6: one
  `mxfp4_experts` call against the engine's bf16 experts (ClampedSwiGLU: fused W1/W3 F.linear,
  clamped SwiGLU, W2 F.linear) looped over the slots that have rows, as MoE._run_slots does.

Weights stream from memory as in a model's step: each FP8 shape cycles through enough copies
to overflow the last-level cache, and each call's experts are drawn at random from the 64.
Times are the best of `--repeats` calls after warm-up, in ms (the best: the machine this
was written on is shared, and a descheduled thread stalls a call by a whole time slice);
ratio = bf16 / kernel.

    PYTHONPATH=. .venv/bin/python benchmarks/blockscaled_kernels.py [--threads N] [--repeats 50]
        [--linear-shapes 2048x2048 4096x2048] [--intermediate 768 1536]
"""

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepwell.engine.layers.blockscaled import (
    MxFp4Experts,
    bf16_linear,
    fp8_block_linear,
    mxfp4_experts,
    native_kernel,
)
from deepwell.engine.models.deepseek_v41.moe import ClampedSwiGLU
from deepwell.engine.models.deepseek_v41.weight_formats import (
    dequantize_fp8_blocks,
    dequantize_mxfp4,
    quantize_fp8_blocks,
    quantize_mxfp4,
)

ROWS = (1, 16)
LINEAR_SHAPES = ((2048, 2048), (4096, 2048))
HEAD_SHAPE = (32768, 2048)
HIDDEN, EXPERTS, TOP_K, LIMIT = 2048, 64, 6, 10.0
# Bytes of weights each FP8 shape cycles through (bf16 copies twice that): well past a
# 32 MiB L3.
STREAM_BYTES = 128 << 20


def best_ms(call: Callable[[int], object], repeats: int) -> float:
    for i in range(3):
        call(i)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def linear_rows(
    out_features: int, in_features: int, rows: int, repeats: int
) -> tuple[float, float]:
    weight, scale = quantize_fp8_blocks(torch.randn(out_features, in_features) * 0.02)
    dense = dequantize_fp8_blocks(weight, scale).bfloat16()
    copies = max(2, STREAM_BYTES // weight.numel())
    fp8 = [(weight.clone(), scale.clone()) for _ in range(copies)]
    bf16 = [dense.clone() for _ in range(copies)]
    x = torch.randn(rows, in_features).bfloat16()
    kernel = best_ms(lambda i: fp8_block_linear(x, *fp8[i % copies]), repeats)
    baseline = best_ms(lambda i: F.linear(x, bf16[i % copies]), repeats)
    return kernel, baseline


def head_rows(rows: int, repeats: int) -> tuple[float, float]:
    weight = torch.randn(HEAD_SHAPE).bfloat16()
    copies = max(2, STREAM_BYTES // (2 * weight.numel()))
    heads = [weight.clone() for _ in range(copies)]
    x = torch.randn(rows, HEAD_SHAPE[1]).bfloat16()
    kernel = best_ms(lambda i: bf16_linear(x, heads[i % copies]), repeats)
    baseline = best_ms(lambda i: F.linear(x, heads[i % copies]), repeats)
    return kernel, baseline


def expert_layer(intermediate: int) -> tuple[MxFp4Experts, list[ClampedSwiGLU]]:
    parts: dict[str, list[torch.Tensor]] = {
        k: [] for k in ("w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale")
    }
    modules = []
    for _ in range(EXPERTS):
        dense = {}
        for name, shape in (
            ("w1", (intermediate, HIDDEN)),
            ("w3", (intermediate, HIDDEN)),
            ("w2", (HIDDEN, intermediate)),
        ):
            data, scale = quantize_mxfp4(torch.randn(shape) * 0.02)
            parts[name].append(data)
            parts[f"{name}_scale"].append(scale)
            dense[name] = dequantize_mxfp4(data, scale)
        module = ClampedSwiGLU(HIDDEN, intermediate, LIMIT).bfloat16()
        module.w13.weight.data.copy_(torch.cat((dense["w1"], dense["w3"])))
        module.w2.weight.data.copy_(dense["w2"])
        modules.append(module)
    return MxFp4Experts.from_tensors(**parts), modules


def bf16_experts(
    x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, modules: list[ClampedSwiGLU]
) -> torch.Tensor:
    """MoE._run_slots's loop (without expert parallelism or invariant tiles)."""
    out = x.new_empty(x.shape)
    order = slots.argsort(stable=True)
    start = 0
    for slot, count in enumerate(torch.bincount(slots, minlength=len(modules)).tolist()):
        if not count:
            continue
        picked = order[start : start + count]
        out[picked] = modules[slot](x[picked], weights[picked])
        start += count
    return out


def expert_rows(
    experts: MxFp4Experts, modules: list[ClampedSwiGLU], tokens: int, repeats: int
) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(tokens)
    draws = [
        torch.stack(
            [torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]
        ).flatten()
        for _ in range(16)
    ]
    x = torch.randn(tokens * TOP_K, HIDDEN, generator=gen).bfloat16()
    weights = torch.rand(tokens * TOP_K, generator=gen)
    kernel = best_ms(lambda i: mxfp4_experts(x, draws[i % 16], weights, experts, LIMIT), repeats)
    baseline = best_ms(
        lambda i: bf16_experts(x, draws[i % 16], weights.bfloat16(), modules), repeats
    )
    return kernel, baseline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--intermediate", type=int, nargs="+", default=[768, 1536])
    parser.add_argument(
        "--linear-shapes",
        nargs="+",
        default=[f"{o}x{i}" for o, i in LINEAR_SHAPES],
        help="FP8 linears as OUTxIN (the medium checkpoint's: 512x1024 2048x512 128x1024 "
        "1024x1024 1024x512)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = native_kernel()
    path = "torch reference" if kernel is None else kernel.instruction_set()
    print(f"threads {args.threads}, kernel path {path}, load average {os.getloadavg()[0]:.2f}")
    print(f"{'what':34} {'rows':>4} {'kernel ms':>10} {'bf16 ms':>10} {'ratio':>6}")
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.linear_shapes]
    for out_features, in_features in shapes:
        for rows in ROWS:
            ours, theirs = linear_rows(out_features, in_features, rows, args.repeats)
            what = f"fp8 linear {out_features}x{in_features}"
            print(f"{what:34} {rows:>4} {ours:>10.3f} {theirs:>10.3f} {theirs / ours:>5.2f}x")
    for rows in ROWS:
        ours, theirs = head_rows(rows, args.repeats)
        what = f"bf16 head {HEAD_SHAPE[0]}x{HEAD_SHAPE[1]}"
        print(f"{what:34} {rows:>4} {ours:>10.3f} {theirs:>10.3f} {theirs / ours:>5.2f}x")
    for intermediate in args.intermediate:
        experts, modules = expert_layer(intermediate)
        for tokens in ROWS:
            ours, theirs = expert_rows(experts, modules, tokens, args.repeats)
            what = f"experts h{HIDDEN} i{intermediate} {EXPERTS}e top{TOP_K}"
            print(f"{what:34} {tokens:>4} {ours:>10.3f} {theirs:>10.3f} {theirs / ours:>5.2f}x")
        del experts, modules
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
