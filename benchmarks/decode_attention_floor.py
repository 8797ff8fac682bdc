"""The decode attention kernel against its read floor, same process: a loop that only reads
the same K/V tiles in the kernel's order, with and without the kernel's prefetches.

W-like shapes (`decode_attention.py`'s `w_like_step`: SmolLM2-135M's 9 query heads over 3 KV
heads of 64 dims, 128-token blocks), `--layers` distinct caches cycled through so that they
outgrow the CPU caches as W's 30 layers do. The read loop walks each (row, KV head) task's
blocks as `sequence_task` does, summing the key tile and then the value tile a key at a
time; "prefetched" also asks, a key at a time while the values are read, for the next
block's key row into L1 and its value row into L2, as the kernel's value pass does. The
three run interleaved, `--repeats` times each; medians of thread CPU time, in ns a key a KV
head (one 64-dim key and value row read). The kernel's time over the prefetched read is the
share of its time the arithmetic adds to the reads.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_attention_floor.py [--rows 64]
        [--repeats 60] [--layers 31]
"""

import argparse
import os
import statistics
import time

import torch
from decode_attention import KV_HEADS, w_like_step
from torch.utils.cpp_extension import load_inline

from deepwell.engine.layers.decode_kernel import load_decode_kernel

READ_LOOP = r"""
#include <torch/extension.h>
#include <immintrin.h>

// Sums every key and value row the decode kernel reads, in its order: per (row, KV head),
// the row's blocks, each block's key tile then its value tile. prefetched: while a value row
// is read, the next block's key row goes to L1 and its value row to L2.
double read_tiles(const torch::Tensor& keys, const torch::Tensor& values,
                  const torch::Tensor& block_ids, const torch::Tensor& block_starts,
                  const torch::Tensor& context_lens, bool prefetched) {
  const int64_t kv_heads = keys.size(1), block_size = keys.size(2), row_bytes = keys.size(3) * 2;
  const char* k = static_cast<const char*>(keys.data_ptr());
  const char* v = static_cast<const char*>(values.data_ptr());
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  const int64_t* starts = block_starts.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t tile = block_size * row_bytes;
  __m512i sum = _mm512_setzero_si512();
  for (int64_t row = 0; row < context_lens.numel(); ++row) {
    for (int64_t head = 0; head < kv_heads; ++head) {
      const int64_t blocks = starts[row + 1] - starts[row];
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = (ids[starts[row] + b] * kv_heads + head) * tile;
        const int64_t next = b + 1 < blocks ? (ids[starts[row] + b + 1] * kv_heads + head) * tile : -1;
        const int64_t n = std::min(block_size, lens[row] - b * block_size);
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t line = 0; line < row_bytes; line += 64) {
            sum = _mm512_add_epi32(sum, _mm512_loadu_si512(k + at + t * row_bytes + line));
          }
        }
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t line = 0; line < row_bytes; line += 64) {
            if (prefetched && next >= 0) {
              _mm_prefetch(k + next + t * row_bytes + line, _MM_HINT_T0);
              _mm_prefetch(v + next + t * row_bytes + line, _MM_HINT_T1);
            }
            sum = _mm512_add_epi32(sum, _mm512_loadu_si512(v + at + t * row_bytes + line));
          }
        }
      }
    }
  }
  return static_cast<double>(_mm512_reduce_add_epi32(sum));
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--layers", type=int, default=31)
    args = parser.parse_args()
    torch.set_num_threads(1)
    reader = load_inline(
        "deepwell_decode_read_floor",
        cpp_sources=READ_LOOP,
        functions=["read_tiles"],
        extra_cflags=["-O2", "-march=native"],
    )
    kernel = load_decode_kernel().module
    q, keys, values, meta = w_like_step(args.rows, torch.bfloat16)
    caches = [(keys, values)] + [
        (torch.randn(keys.shape).bfloat16(), torch.randn(keys.shape).bfloat16())
        for _ in range(args.layers - 1)
    ]
    blocks = (meta.decode_block_ids, meta.decode_block_starts, meta.decode_context_len_tensor)
    paths = {
        "kernel": lambda k, v: kernel.paged_decode(
            q, k, v, *blocks, meta.decode_sequence_starts, HEAD_SCALE, False
        ),
        "read, prefetched": lambda k, v: reader.read_tiles(k, v, *blocks, True),
        "read, demand only": lambda k, v: reader.read_tiles(k, v, *blocks, False),
    }
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    calls = 0
    for _ in range(args.repeats):
        for name, call in paths.items():
            layer_keys, layer_values = caches[calls % len(caches)]
            calls += 1
            started = time.thread_time()
            call(layer_keys, layer_values)
            cpu[name].append(time.thread_time() - started)
    key_heads = sum(meta.decode_context_lens) * KV_HEADS
    ns = {name: statistics.median(times) * 1e9 / key_heads for name, times in cpu.items()}
    print(
        f"decode attention against its reads: {args.rows} rows, {sum(meta.decode_context_lens)} "
        f"keys, bf16, 1 thread, {args.repeats} interleaved repeats over {args.layers} layers' "
        f"caches; load average {os.getloadavg()[0]:.2f}"
    )
    for name, value in ns.items():
        print(f"  {name:18s} {value:5.1f} ns a key a KV head")
    print(f"  kernel / prefetched read {ns['kernel'] / ns['read, prefetched']:.2f}x")


# The decode kernel's scale for head_dim 64; the time does not depend on it.
HEAD_SCALE = 0.125

if __name__ == "__main__":
    main()
