"""The embedded GGUF's load against gguf's stock read of the same file, in one process.

deepwell's `load_checkpoint` (gguf's reader over a plain view of the file's mapping, Q4_1 and
Q8_0 dequantised in torch) against what it did before: `gguf.GGUFReader` and
`gguf.quants.dequantize` of every tensor into float32. The two alternate for `--rounds`
rounds and each keeps its least thread CPU time (one torch thread, as the test servers run);
every server start and in-process `LLM()` of the embedded model pays this load once. deepwell's
side does more (the tokenizer, the rotary permutation, the blocks kept for int4).

    PYTHONPATH=. .venv/bin/python benchmarks/gguf_load.py [--rounds 5]
"""

import argparse
import time

import numpy as np
import torch


def stock_read(path) -> int:
    """gguf's own reader and dequantiser over every tensor: the float32 bytes produced."""
    import gguf

    reader = gguf.GGUFReader(path)
    produced = 0
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        produced += torch.from_numpy(np.array(values, dtype=np.float32)).nbytes
    return produced


def deepwell_load(path) -> int:
    from deepwell.engine.models.loader import load_gguf

    return sum(tensor.nbytes for tensor in load_gguf(path).tensors.values())


def timed(load, path, times: list[float]) -> int:
    """`load(path)`'s result; its thread CPU seconds appended to `times`."""
    started = time.thread_time()
    produced = load(path)
    times.append(time.thread_time() - started)
    return produced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from deepwell.engine.models.loader import embedded_model_path

    path = embedded_model_path()
    stock: list[float] = []
    ours: list[float] = []
    for _ in range(args.rounds):
        stock_bytes = timed(stock_read, path, stock)
        our_bytes = timed(deepwell_load, path, ours)
    assert stock_bytes == our_bytes, (stock_bytes, our_bytes)
    print(f"{path.name}: {our_bytes / 1e6:.0f} MB of float32 tensors, {args.rounds} rounds")
    print(f"  gguf's reader and dequantiser: {min(stock):.2f} thread CPU s (best)")
    print(f"  deepwell's load_checkpoint:    {min(ours):.2f} thread CPU s (best)")
    print(f"  ratio stock / deepwell: {min(stock) / min(ours):.2f}x")


if __name__ == "__main__":
    main()
