"""Prefill attention of one chunk (prefill_attention.cpp) on W-like shapes: the kernel's two
forms of the bf16 products, VDPBF16PS and FMAs on the widened halves, in the same process.

SmolLM2-135M's heads (9 query heads over 3 KV heads of 64 dims) on 128-token cache blocks;
a chunk of `length` prompt tokens ending a context of `context` keys, for W's prompts of
64-512 tokens. The two forms run interleaved, `--repeats` times each on the same inputs,
and their medians of thread CPU time (which a busy machine inflates less than wall time)
are compared; their outputs must be equal bit for bit. Prints ns a (query head, visible key)
pair, the ratio FMA / VDPBF16PS and the load average.

    PYTHONPATH=. .venv/bin/python benchmarks/prefill_chunk_attention.py [--repeats 40]
        [--threads 1] [--shapes 64:64,128:128,256:256,512:512,128:512]
"""

import argparse
import os
import statistics
import time

import torch

from deepwell.engine.layers.decode_kernel import load_prefill_kernel

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 128
FORMS = ("dpbf16", "fma")


def chunk_inputs(length: int, context: int, seed: int):
    """q (a view into a fused q/k/v projection, as the model hands it over), the caches on
    shuffled blocks with spare ones around, and the block table."""
    gen = torch.Generator().manual_seed(seed)
    used = -(-context // BLOCK_SIZE)
    shape = (used + 4, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    keys = torch.randn(shape, generator=gen).bfloat16()
    values = torch.randn(shape, generator=gen).bfloat16()
    table = torch.randperm(used + 4, generator=gen)[:used]
    q = torch.randn(length, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    return q[:, :HEADS], keys, values, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--shapes",
        default="64:64,128:128,256:256,512:512,128:512",
        help="length:context pairs, comma-separated",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = load_prefill_kernel()
    if kernel.module is None or not kernel.module.vectorised():
        raise SystemExit(f"prefill attention kernel unavailable here: {kernel.reason}")
    print(
        f"chunk attention, {HEADS} heads over {KV_HEADS} KV heads of {HEAD_DIM}, "
        f"{args.threads} thread(s), {args.repeats} interleaved repeats; thread CPU medians"
    )
    for seed, shape in enumerate(args.shapes.split(",")):
        length, context = (int(n) for n in shape.split(":"))
        q, keys, values, table = chunk_inputs(length, context, seed)
        outs = {form: torch.empty(length, HEADS, HEAD_DIM, dtype=torch.bfloat16) for form in FORMS}
        cpu: dict[str, list[float]] = {form: [] for form in FORMS}
        for _ in range(args.repeats):
            for form in FORMS:
                started = time.thread_time()
                kernel.module.chunk_attention(
                    q, keys, values, table, context, HEAD_DIM**-0.5, outs[form], form
                )
                cpu[form].append(time.thread_time() - started)
        same = torch.equal(outs["dpbf16"].view(torch.int16), outs["fma"].view(torch.int16))
        visible = HEADS * (length * (context - length) + length * (length + 1) // 2)
        median = {form: statistics.median(times) for form, times in cpu.items()}
        print(
            f"  {length:4d} tokens after {context - length:4d}: "
            + ", ".join(
                f"{form} {median[form] * 1e3:.3f} ms ({median[form] * 1e9 / visible:.2f} ns)"
                for form in FORMS
            )
            + f"; fma / dpbf16 {median['fma'] / median['dpbf16']:.3f}x, bits "
            + ("equal" if same else "DIFFER")
            + f"; load {os.getloadavg()[0]:.2f}"
        )


if __name__ == "__main__":
    main()
