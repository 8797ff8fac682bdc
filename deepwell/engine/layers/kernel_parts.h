// What the whole-step decoder (llama_decode.cpp) calls in the other kernel sources, compiled
// with them into one extension by layers/decode_kernel.py (DEEPWELL_ONE_EXTENSION).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace deepwell {

// paged_decode.cpp. Every row's block list against a cache of num_blocks blocks: a bad one
// is an error before any is read, never a read outside the cache.
void check_block_lists(
    const int64_t* ids,
    int64_t num_ids,
    const int64_t* starts,
    const int64_t* lens,
    int64_t rows,
    int64_t num_blocks,
    int64_t block_size);

// paged_decode.cpp. Attention of `rows` decode rows over contiguous caches
// [num_blocks, kv_heads, block_size, head_dim]; q [rows, heads, head_dim] (rows q_row apart,
// heads contiguous) and out contiguous alike, of the caches' dtype (float32 or bfloat16);
// block lists already checked.
void paged_decode_rows(
    const void* q,
    int64_t q_row,
    int64_t rows,
    int64_t heads,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const int64_t* ids,
    const int64_t* starts,
    const int64_t* lens,
    float scale,
    void* out);

// Bytes of one block of 32 weights in quant_gemv.cpp's rows: Q4_1 16 of nibbles, fp16 d and
// m; Q8_0 32 of int8, fp16 d, int16 Σq.
constexpr int64_t kQ4_1BlockBytes = 20;
constexpr int64_t kQ8_0BlockBytes = 36;

// A weight in quant_gemv.cpp's layout (layers/quant_linear.py repacks it): one uint8 row of
// `blocks` Q4_1 or Q8_0 blocks per output feature.
struct BlockLinear {
  bool q4_1;
  const uint8_t* weights;
  int64_t out_features;
  int64_t blocks;
};

// quant_gemv.cpp. out [rows, out_features] = x [rows, in_features] times the weight,
// activations quantised per 32-block as the linears do; 1 to 8 rows.
void block_linear(
    const float* x, int64_t rows, int64_t in_features, const BlockLinear& w, float* out);

}  // namespace deepwell
