"""W's KV blocks handed out and written, thread CPU: this tree's KVCache against a baseline
tree's, each round in fresh processes (the pool's first-touch page faults are the cost).

Each process allocates SmolLM2-135M's KV pool (30 layers, key and value, blocks of 128
tokens, 3 KV heads of 64, bf16) with `KVCache.allocate`, then for each of W's requests
(benchmarks/workload.py) hands out its blocks as the engine would through `clear_blocks`:
the prompt's blocks in one call, then one call per block its output reaches. It then writes
each request's K/V rows (every layer, prompt and output tokens) into its blocks. Printed:
the median thread CPU seconds of the clears (the schedule phase's share) and of the writes
(the attention stores' share), and their sum.

    PYTHONPATH=. .venv/bin/python benchmarks/kv_clear.py --baseline /path/to/other/tree
"""

import argparse
import json
import os
import time
from pathlib import Path

from trees_in_turn import medians_in_turn

BLOCK_SIZE = 128
PARTS = ("clear", "write", "sum")


def measure() -> dict[str, float]:
    """Thread CPU seconds of W's block clears and K/V writes, one torch thread."""
    import torch
    from workload import make_workload

    from deepwell.engine.kv.cache import KVCache
    from deepwell.engine.kv.layout import CacheRole, KVLayout, PagedSpec

    torch.set_num_threads(1)
    spec = {"num_layers": 30, "entry_shape": (3, 64), "entry_axis": 1}
    layout = KVLayout(
        paged=(
            PagedSpec("key", role=CacheRole.FULL_ATTENTION, **spec),
            PagedSpec("value", role=CacheRole.FULL_ATTENTION, **spec),
        )
    )
    workload = make_workload()
    lengths = [(r["prompt_len"], r["prompt_len"] + r["output_len"]) for r in workload]
    num_blocks = sum(-(-total // BLOCK_SIZE) for _, total in lengths)
    cache = KVCache.allocate(layout, num_blocks, BLOCK_SIZE, 1, torch.bfloat16)
    calls = []
    next_block = 0
    for prompt, total in lengths:
        prompt_blocks = -(-prompt // BLOCK_SIZE)
        calls.append(list(range(next_block, next_block + prompt_blocks)))
        extra = -(-total // BLOCK_SIZE) - prompt_blocks
        calls += [[next_block + prompt_blocks + i] for i in range(extra)]
        next_block += prompt_blocks + extra
    start = time.thread_time()
    for block_ids in calls:
        cache.clear_blocks(block_ids)
    clear = time.thread_time() - start
    rows = torch.ones(3, BLOCK_SIZE, 64, dtype=torch.bfloat16)
    start = time.thread_time()
    first = 0
    for _, total in lengths:
        for index in range(-(-total // BLOCK_SIZE)):
            used = min(BLOCK_SIZE, total - index * BLOCK_SIZE)
            for tensor in cache.block_tensors():
                tensor[first + index, :, :used] = rows[:, :used]
        first += -(-total // BLOCK_SIZE)
    write = time.thread_time() - start
    return {"clear": clear, "write": write, "sum": clear + write}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="the tree to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return
    medians = medians_in_turn(__file__, args.baseline, args.rounds, PARTS, [])
    print(f"load average {os.getloadavg()[0]:.2f}; median thread CPU s of {args.rounds} rounds")
    for name, parts in medians.items():
        print(f"  {name:8} " + ", ".join(f"{p} {v:.3f}" for p, v in parts.items()))
    ratios = ", ".join(f"{p} {medians['this'][p] / medians['baseline'][p]:.2f}" for p in PARTS)
    print(f"  this / baseline: {ratios}")


if __name__ == "__main__":
    main()
