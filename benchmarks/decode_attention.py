"""Decode attention of one layer: the fused C++ kernel against the torch path, same process.

W-like shapes (SmolLM2-135M: 9 query heads over 3 KV heads of 64 dims, 128-token blocks):
`--rows` decode rows whose contexts are a W prompt (64–512 tokens) plus part of its output
(up to 256), each on its own blocks of a compact pool, as a fresh engine places them. The
two paths run interleaved, `--repeats` times each, and the medians are compared, so a busy
machine slows both alike; the load average is printed with them.

    .venv/bin/python benchmarks/decode_attention.py [--rows 64] [--threads 1]
        [--dtype bfloat16] [--repeats 200]
"""

import argparse
import os
import random
import statistics
import time

import torch

from deepwell.engine.layers.attention import AttentionMetadata
from deepwell.engine.layers.cpp_paged import CppPagedAttention
from deepwell.engine.layers.torch_paged import TorchPagedAttention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 128


def w_like_step(rows: int, dtype: torch.dtype, seed: int = 0):
    """q, caches and metadata of a decode step over `rows` W-like contexts."""
    rng = random.Random(seed)
    lens = [rng.randint(64, 512) + rng.randint(1, rng.randint(64, 256)) for _ in range(rows)]
    counts = [-(-n // BLOCK_SIZE) for n in lens]
    pool = list(range(sum(counts)))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(c)] for c in counts]
    cache_shape = (sum(counts) + 8, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    keys, values = torch.randn(cache_shape).to(dtype), torch.randn(cache_shape).to(dtype)
    block_ids = [b for t in tables for b in t]
    meta = AttentionMetadata(
        slot_blocks=torch.empty(0, dtype=torch.long),
        slot_offsets=torch.empty(0, dtype=torch.long),
        num_decodes=rows,
        decode_context_lens=lens,
        decode_blocks=block_ids,
        block_size=BLOCK_SIZE,
        prefills=[],
    )
    # A view into the fused q/k projection, as the model hands it over.
    q = torch.randn(rows, HEADS + KV_HEADS, HEAD_DIM).to(dtype)[:, :HEADS]
    return q, keys, values, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument(
        "--layers",
        type=int,
        default=31,
        help="distinct caches cycled through, as a step's 30 layers are (odd, so that the "
        "two paths take turns on each): together they outgrow the CPU caches, as in W",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    q, keys, values, meta = w_like_step(args.rows, getattr(torch, args.dtype))
    caches = [(keys, values)] + [
        (torch.randn(keys.shape).to(keys.dtype), torch.randn(keys.shape).to(keys.dtype))
        for _ in range(args.layers - 1)
    ]
    paths = {
        "torch": TorchPagedAttention(HEADS, KV_HEADS, HEAD_DIM),
        "cpp": CppPagedAttention(HEADS, KV_HEADS, HEAD_DIM),
    }
    outs = {name: backend._decode(q, keys, values, meta) for name, backend in paths.items()}
    diff = (outs["cpp"].float() - outs["torch"].float()).abs().max().item()
    # Wall time, and the process's CPU time, which a busy machine inflates less.
    walls: dict[str, list[float]] = {name: [] for name in paths}
    cpus: dict[str, list[float]] = {name: [] for name in paths}
    calls = 0
    for _ in range(args.repeats):
        for name, backend in paths.items():
            # Every call reads the next layer's cache: neither path finds the other's reads
            # in the CPU caches.
            layer_keys, layer_values = caches[calls % len(caches)]
            calls += 1
            wall, cpu = time.perf_counter(), time.process_time()
            backend._decode(q, layer_keys, layer_values, meta)
            walls[name].append(time.perf_counter() - wall)
            cpus[name].append(time.process_time() - cpu)
    medians = {name: statistics.median(t) * 1e3 for name, t in walls.items()}
    cpu = {name: statistics.median(t) * 1e3 for name, t in cpus.items()}
    print(
        f"decode attention, one layer: {args.rows} rows, {len(meta.decode_block_ids)} blocks, "
        f"{sum(meta.decode_context_lens)} keys, {args.dtype}, {args.threads} thread(s), "
        f"{args.repeats} interleaved repeats over {args.layers} layers' caches; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    # Per key of a row's context and KV head: one [head_dim] key and value read, the GQA
    # group's scores and weighted values; comparable across row counts and contexts.
    key_heads = sum(meta.decode_context_lens) * KV_HEADS
    for name, median in medians.items():
        print(
            f"  {name:5s} median wall {median:.3f} ms, CPU {cpu[name]:.3f} ms "
            f"({cpu[name] * 1e6 / key_heads:.1f} ns a key a KV head)"
        )
    print(
        f"  speed-up: wall {medians['torch'] / medians['cpp']:.2f}x, "
        f"CPU {cpu['torch'] / cpu['cpp']:.2f}x; max |cpp - torch| {diff:.2e}"
    )


if __name__ == "__main__":
    main()
