"""Decode linears on GGUF blocks (`--quantization int4`, quant_gemv.cpp) against torch's int4
pack kernel, packed bf16 and float32, at the row counts of decode steps; then the engine's
batch-1 decode with and without it.

Part 1 times SmolLM2-135M's linear shapes (random weights; the kernel's Q4_1 layers and
Q8_0 head; what `--quantization int4` ran before, torch's `_weight_int4pack_mm_for_cpu`
with 32-groups for the layers and a bf16 head; oneDNN-packed bf16; float32 F.linear) at 1,
2, 4, 6 and 8 rows: each shape alone with its weights hot in cache, then one step's linears
in model order (30 distinct layers of qkv, o, gate_up and down, then the 49,152-row head),
whose weights stream from memory as in the engine. Part 2 runs the embedded model
(synchronous steps, no speculation, no prefix cache): batch-1 decode tok/s of 128 tokens
after a 64-token prompt, as benchmarks/throughput_vs_hf.py measures it. Prints ratios and
the load average.

    .venv/bin/python benchmarks/quant_decode.py [--threads 1] [--repeats 200] [--skip-engine]
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F

from deepwell.engine.layers.decode_kernel import load_quant_kernel
from deepwell.engine.layers.quant_linear import quantize_q4_1, quantize_q8_0, to_decode_linear

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
# (name, in, out): one layer's fused projections, then the head.
SHAPES = [
    ("qkv", HIDDEN, 960),
    ("o", HIDDEN, HIDDEN),
    ("gate_up", HIDDEN, 2 * INTERMEDIATE),
    ("down", INTERMEDIATE, HIDDEN),
    ("head", HIDDEN, VOCAB),
]
ROWS = (1, 2, 4, 6, 8)


def best_ms(fn, x: torch.Tensor | None, repeats: int) -> float:
    for _ in range(5):
        fn(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def linear_methods(in_features: int, out_features: int, head: bool, kernel) -> dict:
    weight = torch.randn(out_features, in_features) * 0.05
    blocks = quantize_q8_0(weight) if head else quantize_q4_1(weight)
    gguf = torch.nn.Linear(in_features, out_features, bias=False)
    gguf.weight.data.copy_(blocks.dequantize())
    to_decode_linear(gguf, blocks, kernel)
    bf16 = weight.to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(bf16, None)
    q4 = quantize_q4_1(weight)
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.q.flatten(1).to(torch.int32), 1)
    # torch's form: w = (q - 8) * scale + zero per group, [groups, out, 2] in bf16.
    scales_zeros = torch.stack((q4.d, q4.m + 8 * q4.d), dim=-1).transpose(0, 1).contiguous()
    scales_zeros = scales_zeros.to(torch.bfloat16)

    def dense_bf16(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")

    def torch_int4(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4, 32, scales_zeros)

    return {
        "gguf": (gguf, torch.bfloat16),
        # What `--quantization int4` ran before: torch's int4 for the layers, the head bf16.
        "torch int4": (dense_bf16 if head else torch_int4, torch.bfloat16),
        "bf16": (dense_bf16, torch.bfloat16),
        "float32": (lambda x: F.linear(x, weight), torch.float32),
    }


def linears(args, kernel) -> None:
    """Each shape alone, its weights hot in cache; then whole steps over 30 distinct layers
    and the head, in model order, whose weights stream from memory as in the engine."""
    print(
        f"{args.threads} thread(s), instruction set {kernel.instruction_set()}; best of "
        "repeats (a shared machine: the minimum is the least disturbed)"
    )
    print("per linear, weights hot in cache, ms:")
    for name, in_features, out_features in SHAPES:
        methods = linear_methods(in_features, out_features, name == "head", kernel)
        for rows in ROWS:
            times = {}
            for method, (fn, dtype) in methods.items():
                x = torch.randn(rows, in_features).to(dtype)
                times[method] = best_ms(fn, x, args.repeats)
            print(
                f"  {name:8s} rows {rows}: "
                + ", ".join(f"{m} {t:.3f}" for m, t in times.items())
                + f"  (bf16 / gguf {times['bf16'] / times['gguf']:.2f}x)"
            )
    layers = [
        linear_methods(i, o, name == "head", kernel)
        for _ in range(LAYERS)
        for name, i, o in SHAPES
        if name != "head"
    ]
    layers.append(linear_methods(HIDDEN, VOCAB, True, kernel))
    print("one decode step's linears (30 distinct layers + head, weights from memory), ms:")
    for rows in ROWS:
        times = {}
        for method in layers[0]:
            shapes = [s for s in SHAPES if s[0] != "head"] * LAYERS + [SHAPES[-1]]
            calls = [
                (m[method][0], torch.randn(rows, i).to(m[method][1]))
                for m, (_, i, _) in zip(layers, shapes, strict=True)
            ]
            times[method] = best_ms(
                lambda _, calls=calls: [fn(x) for fn, x in calls], None, args.step_repeats
            )
        print(
            f"  rows {rows}: "
            + ", ".join(f"{m} {t:.2f}" for m, t in times.items())
            + f"  ratios: torch int4 / gguf {times['torch int4'] / times['gguf']:.2f}x, "
            f"bf16 / gguf {times['bf16'] / times['gguf']:.2f}x, "
            f"float32 / gguf {times['float32'] / times['gguf']:.2f}x"
        )


def engine_decode(args) -> None:
    from deepwell.engine import LLM, SamplingParams

    prompt = list(range(1000, 1064))
    greedy = {"temperature": 0, "ignore_eos": True}
    print(f"engine batch-1 decode, {args.decode_tokens} tokens after a 64-token prompt:")
    rates = {}
    for dtype in ("bfloat16", "float32"):
        for quantization in ("none", "int4"):
            llm = LLM(
                dtype=dtype,
                quantization=quantization,
                enable_prefix_caching=False,
                num_speculative_tokens=0,
                num_threads=args.threads,
                decode_sequence=False,
            )

            def timed(tokens: int, llm=llm) -> float:
                start = time.perf_counter()
                params = SamplingParams(max_tokens=tokens, **greedy)
                llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
                return time.perf_counter() - start

            timed(8)
            first = min(timed(1) for _ in range(3))
            full = min(timed(args.decode_tokens + 1) for _ in range(2))
            rates[dtype, quantization] = args.decode_tokens / (full - first)
            print(f"  {dtype} {quantization}: {rates[dtype, quantization]:.1f} tok/s")
            del llm
    for dtype in ("bfloat16", "float32"):
        ratio = rates[dtype, "int4"] / rates[dtype, "none"]
        print(f"  {dtype}: int4 / none {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--step-repeats", type=int, default=20)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = load_quant_kernel().module
    if kernel is None:
        raise SystemExit(f"no kernel: {load_quant_kernel().reason}")
    print(f"load average before: {os.getloadavg()}")
    linears(args, kernel)
    if not args.skip_engine:
        engine_decode(args)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
