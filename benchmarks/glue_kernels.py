"""The Llama layer's fused glue kernels alone at workload W's shapes (SmolLM2 in bf16): the
rotary pass (llama_rotary.cpp) and the residual add + RMSNorm and silu * up (llama_glue.cpp).

One torch thread; each kernel's thread CPU time (`time.thread_time`) per call, best of
`--repeats` rounds, on a ~1,000-row prefill chunk and a 55-row decode step. The kernels come
from the tree on PYTHONPATH, so two trees compare by running this in each, interleaved:

    PYTHONPATH=. .venv/bin/python benchmarks/glue_kernels.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from deepwell.engine.layers.decode_kernel import load_decode_kernel, load_llama_rotary_kernel
from deepwell.engine.layers.rotary import RotaryEmbedding

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query and 3 KV heads of 64.
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64
ROWS = (1000, 55)
# Calls per timed round: about 20 ms of work each at the larger shape.
CALLS = {1000: 40, 55: 600}


def seconds_per_call(call: Callable[[], object], calls: int, repeats: int) -> float:
    """The best round's thread CPU seconds per call (the round least disturbed by others)."""
    call()
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        for _ in range(calls):
            call()
        best = min(best, (time.thread_time() - started) / calls)
    return best


def cases(rows: int) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(rows)
    rotary = RotaryEmbedding(HEAD_DIM, 10000.0, 8192, torch.bfloat16)
    positions = torch.randint(0, 8192, (rows,), generator=gen)
    cos, sin = rotary.lookup(positions)
    # The q and k heads inside the fused qkv projection's rows, as the model splits them.
    qkv = torch.randn(rows, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    qk = qkv[:, : HEADS + KV_HEADS]
    gate_up = (torch.randn(rows, 2 * INTERMEDIATE, generator=gen) * 4).bfloat16()
    residual = torch.randn(rows, HIDDEN, generator=gen)
    delta = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
    weight = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    rotate = torch.ops.deepwell_llama_rotary.rotate
    glue = torch.ops.deepwell_glue
    return {
        "rotate": lambda: rotate(qk, cos, sin),
        "silu_mul": lambda: glue.silu_mul(gate_up),
        # The residual grows a little each call: the same work, and no copy is timed.
        "add_rms_norm": lambda: glue.add_rms_norm(residual, delta, weight, 1e-5, torch.bfloat16),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for loaded in (load_decode_kernel(), load_llama_rotary_kernel()):
        assert loaded.module is not None, loaded.reason
    print(f"torch {torch.__version__} at {torch.backends.cpu.get_cpu_capability()}, 1 thread")
    for rows in ROWS:
        for name, call in cases(rows).items():
            seconds = seconds_per_call(call, CALLS[rows], args.repeats)
            print(f"{name:>12} {rows:>5} rows: {seconds * 1e6:9.1f} us a call")


if __name__ == "__main__":
    main()
