// Fused paged-attention decode on CPU: one pass over each row's KV blocks through its
// block list, online softmax, no gather; built on first use by layers/decode_kernel.py.
//
// Cache layout [num_blocks, kv_heads, block_size, head_dim] (kv/layout.py): one block of
// one KV head is a contiguous [block_size, head_dim] tile, read once per (row, KV head)
// task for all the GQA group's query heads. Scores, softmax and the output accumulate in
// float32 whatever the cache dtype.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include "kernel_parts.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
// head_dim is walked in chunks of two float vectors (one bf16 vector's worth), the last
// one partial when head_dim is not a multiple.
constexpr int64_t kChunk = 2 * Vec::size();
// Registers hold the group's accumulators: at most this many query heads per KV head.
constexpr int64_t kMaxGroup = 8;

// A chunk of `width` <= kChunk values as two float vectors; lanes past width read as 0.
inline void load_chunk(const float* src, int64_t width, Vec& lo, Vec& hi) {
  if (width == kChunk) {
    lo = Vec::loadu(src);
    hi = Vec::loadu(src + Vec::size());
    return;
  }
  lo = Vec::loadu(src, std::min<int64_t>(width, Vec::size()));
  hi = width > Vec::size() ? Vec::loadu(src + Vec::size(), width - Vec::size()) : Vec(0.f);
}

inline void load_chunk(const at::BFloat16* src, int64_t width, Vec& lo, Vec& hi) {
  using BVec = at::vec::Vectorized<at::BFloat16>;
  auto both = at::vec::convert_to_float<at::BFloat16>(
      width == kChunk ? BVec::loadu(src) : BVec::loadu(src, width));
  lo = std::get<0>(both);
  hi = std::get<1>(both);
}

inline void store_chunk(Vec lo, Vec hi, int64_t width, float* dst) {
  if (width == kChunk) {
    lo.store(dst);
    hi.store(dst + Vec::size());
    return;
  }
  lo.store(dst, std::min<int64_t>(width, Vec::size()));
  if (width > Vec::size()) hi.store(dst + Vec::size(), width - Vec::size());
}

inline void store_chunk(Vec lo, Vec hi, int64_t width, at::BFloat16* dst) {
  auto packed = at::vec::convert_from_float<at::BFloat16>(lo, hi);
  if (width == kChunk) {
    packed.store(dst);
  } else {
    packed.store(dst, width);
  }
}

// exp(x - shift) over n scores in place; returns their sum. Scores are finite (only real
// keys are scored), so the fast exp's range clamps never matter.
inline float exp_and_sum(float* scores, int64_t n, float shift) {
  Vec total(0.f);
  int64_t t = 0;
  for (; t + Vec::size() <= n; t += Vec::size()) {
    Vec p = (Vec::loadu(scores + t) - Vec(shift)).exp_u20();
    p.store(scores + t);
    total = total + p;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, total);
  for (; t < n; ++t) {
    scores[t] = std::exp(scores[t] - shift);
    sum += scores[t];
  }
  return sum;
}

// Asks the memory system for rows [begin, end) of a [block_size, head_dim] tile a phase
// ahead of their use. The cache holds a step's KV of every layer, far beyond the CPU's
// caches, and a block's tiles are apart in memory: the hardware prefetchers stop at each.
template <typename T>
inline void prefetch_rows(const T* tile, int64_t begin, int64_t end, int64_t head_dim) {
  const char* first = reinterpret_cast<const char*>(tile + begin * head_dim);
  const char* last = reinterpret_cast<const char*>(tile + end * head_dim);
  for (const char* line = first; line < last; line += 64) __builtin_prefetch(line);
}

// The same into L2 (not L1: a block's K and V tiles are as big as L1), for the next block's
// values while this block's are weighed: they are used a score pass later. Issued a key at a
// time: the whole tile pair at once (512 lines) stalled the core on full line-fill buffers,
// the wait added to the arithmetic rather than overlapping it. On the AMX Xeon, against the
// whole-tile prefetch: 27.6 against 29.9 ns a key a KV head from memory, 10-13 % less from
// L2/L3; W's decode attention 0.95x.
template <typename T>
inline void prefetch_rows_l2(const T* tile, int64_t begin, int64_t end, int64_t head_dim) {
  const char* first = reinterpret_cast<const char*>(tile + begin * head_dim);
  const char* last = reinterpret_cast<const char*>(tile + end * head_dim);
  for (const char* line = first; line < last; line += 64) __builtin_prefetch(line, 0, 2);
}

// The portable scores of one block: per key, a vector of the group's products per query
// head, summed across its lanes.
template <typename T>
void block_scores(
    const float* query,  // [group, head_dim], scaled
    const T* keys,
    const T* values,  // prefetched as the keys are scored
    int64_t n,
    int64_t head_dim,
    int64_t group,
    float* scores,  // [group, block_size]
    int64_t block_size) {
  for (int64_t t = 0; t < n; ++t) {
    prefetch_rows(values, t, t + 1, head_dim);
    Vec dot[kMaxGroup];
    for (int64_t g = 0; g < group; ++g) dot[g] = Vec(0.f);
    for (int64_t d = 0; d < head_dim; d += kChunk) {
      const int64_t width = std::min(kChunk, head_dim - d);
      Vec lo, hi;
      load_chunk(keys + t * head_dim + d, width, lo, hi);
      for (int64_t g = 0; g < group; ++g) {
        Vec q_lo, q_hi;
        load_chunk(query + g * head_dim + d, width, q_lo, q_hi);
        dot[g] = at::vec::fmadd(q_lo, lo, dot[g]);
        dot[g] = at::vec::fmadd(q_hi, hi, dot[g]);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      scores[g * block_size + t] =
          at::vec::vec_reduce_all<float>([](Vec a, Vec c) { return a + c; }, dot[g]);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// AVX2: the portable loop's bits, 8 keys at a time. Each key's products accumulate in one
// vector as there (same lanes, same order: head_dim in runs of 8), with the group's query
// heads in the outer loop so that 8 keys' sums stay in registers (the portable loop's,
// indexed by a runtime group size, live on the stack, every fmadd a store and a reload);
// the 8 vectors are then summed across lanes together in three shuffle rounds, in the
// order of ATen's vec_reduce_all, for about the cost of three of its horizontal sums.

inline bool avx2_scores_fit(int64_t head_dim) { return head_dim % kChunk == 0; }

inline __m256 load8(const float* src) { return _mm256_loadu_ps(src); }
// bf16 widens exactly (its bits are a float's top half), as load_chunk's conversion does.
inline __m256 load8(const at::BFloat16* src) {
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

// Lane j of the result: v[j]'s 8 lanes summed as vec_reduce_all sums them, lane i with
// i + 4 first, then i with i + 2, then the two: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
inline __m256 sum_lanes8(const __m256* v) {
  __m256 halves[4];
  for (int j = 0; j < 4; ++j) {
    // Low 128 bits: v[j]'s lanes i + (i + 4); high: v[j + 4]'s.
    halves[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[j], v[j + 4], 0x20),
                              _mm256_permute2f128_ps(v[j], v[j + 4], 0x31));
  }
  __m256 quads[2];
  for (int j = 0; j < 2; ++j) {
    // Per 128 bits: (x0+x2, x1+x3) of halves[2j]'s vector, then of halves[2j + 1]'s.
    const __m256 a = halves[2 * j], b = halves[2 * j + 1];
    quads[j] = _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return _mm256_add_ps(_mm256_shuffle_ps(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

template <typename T>
void block_scores_avx2(
    const float* query,  // [group, head_dim], scaled
    const T* keys,
    const T* values,  // prefetched as the keys are scored
    int64_t n,
    int64_t head_dim,
    int64_t group,
    float* scores,  // [group, block_size]
    int64_t block_size) {
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - t0);
    prefetch_rows(values, t0, t0 + m, head_dim);
    // Past the block's last key the last one is read again (its sum is not stored): the
    // tile may end before 8 more rows do.
    const T* rows[8];
    for (int64_t j = 0; j < 8; ++j) rows[j] = keys + (t0 + std::min(j, m - 1)) * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* q = query + g * head_dim;
      __m256 dot[8];
      for (int j = 0; j < 8; ++j) dot[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) dot[j] = _mm256_fmadd_ps(qd, load8(rows[j] + d), dot[j]);
      }
      const __m256 sums = sum_lanes8(dot);
      float* out = scores + g * block_size + t0;
      if (m == 8) {
        _mm256_storeu_ps(out, sums);
      } else {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, sums);
        std::copy_n(lanes, m, out);
      }
    }
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// AVX-512: 16 keys at a time, their 16 product vectors summed across lanes together in four
// shuffle rounds (a full horizontal sum per key costs as much as its products). bf16 caches
// multiply bf16 pairs straight into float32 sums (AVX512_BF16's vdpbf16ps), no conversion.

inline bool fast_scores_fit(const float*, int64_t head_dim) { return head_dim % 16 == 0; }

inline __m512 products(const float* q, const float* k, int64_t head_dim) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 16) {
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
  }
  return acc;
}

#if defined(__AVX512BF16__)
inline bool fast_scores_fit(const at::BFloat16*, int64_t head_dim) { return head_dim % 32 == 0; }

inline __m512 products(const at::BFloat16* q, const at::BFloat16* k, int64_t head_dim) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 32) {
    acc = _mm512_dpbf16_ps(
        acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
  }
  return acc;
}
#else
inline bool fast_scores_fit(const at::BFloat16*, int64_t) { return false; }
inline __m512 products(const at::BFloat16*, const at::BFloat16*, int64_t) {
  return _mm512_setzero_ps();
}
#endif

#if defined(__AVX512BF16__)
// A head_dim of 64 (SmolLM2, Llama 3's small models) known at compile time: the query's two
// halves loaded once and 16 keys' two chained vdpbf16ps unrolled, in `products`' order (the
// same bits); the generic loop re-reads the query and branches per 32 values.
inline void products16_hd64(const at::BFloat16* q, const at::BFloat16* keys, __m512* v) {
  const __m512bh q_lo = (__m512bh)_mm512_loadu_si512(q);
  const __m512bh q_hi = (__m512bh)_mm512_loadu_si512(q + 32);
#pragma GCC unroll 16
  for (int64_t j = 0; j < 16; ++j) {
    const at::BFloat16* k = keys + j * 64;
    const __m512 lo =
        _mm512_dpbf16_ps(_mm512_setzero_ps(), q_lo, (__m512bh)_mm512_loadu_si512(k));
    v[j] = _mm512_dpbf16_ps(lo, q_hi, (__m512bh)_mm512_loadu_si512(k + 32));
  }
}
#endif

template <typename T>
void block_scores_avx512(
    const T* q,  // the group's first query head, unscaled
    int64_t q_head_stride,
    const T* keys,
    const T* values,  // prefetched as the keys are scored
    int64_t n,
    int64_t head_dim,
    int64_t group,
    float scale,
    float* scores,
    int64_t block_size) {
  for (int64_t g = 0; g < group; ++g) {
    const T* head = q + g * q_head_stride;
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - t0);
      if (g == 0) prefetch_rows(values, t0, t0 + m, head_dim);
      __m512 v[16];
      bool unrolled = false;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        unrolled = head_dim == 64 && m == 16;
        if (unrolled) products16_hd64(head, keys + t0 * 64, v);
      }
#endif
      for (int64_t j = 0; !unrolled && j < 16; ++j) {
        v[j] = j < m ? products(head, keys + (t0 + j) * head_dim, head_dim) : _mm512_setzero_ps();
      }
      const __m512 sums = _mm512_mul_ps(deepwell::sum_lanes16(v), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(scores + g * block_size + t0, (__mmask16)((1u << m) - 1), sums);
    }
  }
}
#endif

// The largest of n scores. A scalar max chains each comparison on the one before (a fifth
// of the kernel's time by perf, on W-like verify rows); lanes break the chain.
inline float max_of(const float* x, int64_t n) {
  Vec lanes(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + Vec::size() <= n; t += Vec::size()) lanes = at::vec::maximum(lanes, Vec::loadu(x + t));
  float best = at::vec::vec_reduce_all<float>(
      [](Vec a, Vec b) { return at::vec::maximum(a, b); }, lanes);
  for (; t < n; ++t) best = std::max(best, x[t]);
  return best;
}

// The group's accumulators += weights x one block's n values. The group size is a template
// argument so that the accumulators live in registers (indexed by a runtime count they were
// spilled to the stack, each fmadd a load and a store); each head_dim chunk's accumulators
// stay there over the keys, while the next block's keys are fetched.
#if defined(CPU_CAPABILITY_AVX512)
// Whether weigh_two_chunks runs for this head_dim and group; for a bf16 cache it keeps each
// 32-dim chunk's accumulators even dims first, then odd (see load_key_values).
inline bool two_chunk_values(int64_t head_dim, int64_t group) {
  return head_dim == 64 && group <= 4;
}

// A key's 64 values as 4 float vectors: bf16 widens exactly (its bits are a float's top
// half), in place: a 32-bit lane's low bf16 shifted up is dim 2k, its high one masked is
// dim 2k + 1: one instruction a vector, where widening in order takes a cross-lane one more.
inline void load_key_values(const float* src, __m512* v) {
  for (int64_t i = 0; i < 4; ++i) v[i] = _mm512_loadu_ps(src + 16 * i);
}
inline void load_key_values(const at::BFloat16* src, __m512* v) {
  for (int64_t half = 0; half < 2; ++half) {
    const __m512i pairs = _mm512_loadu_si512(src + 32 * half);
    v[2 * half] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    v[2 * half + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(-65536)));
  }
}

// A 32-dim chunk of accumulators kept even dims then odd, back in order.
inline void interleave_dims(Vec& even, Vec& odd) {
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second =
      _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  const __m512 lo = _mm512_permutex2var_ps(even, first, odd);
  odd = _mm512_permutex2var_ps(even, second, odd);
  even = lo;
}

template <typename T, int64_t G>
void weigh_two_chunks(const T* values, int64_t n, const float* weights, int64_t block_size,
                      float* acc, const T* next_keys, const T* next_values) {
  constexpr int64_t head_dim = 4 * 16;
  __m512 sums[G][4];
#pragma GCC unroll 4
  for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 4
    for (int64_t i = 0; i < 4; ++i) sums[g][i] = _mm512_loadu_ps(acc + g * head_dim + 16 * i);
  }
  for (int64_t t = 0; t < n; ++t) {
    if (next_keys != nullptr) {
      prefetch_rows(next_keys, t, t + 1, head_dim);
      prefetch_rows_l2(next_values, t, t + 1, head_dim);
    }
    __m512 v[4];
    load_key_values(values + t * head_dim, v);
#pragma GCC unroll 4
    for (int64_t g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(weights[g * block_size + t]);
#pragma GCC unroll 4
      for (int64_t i = 0; i < 4; ++i) sums[g][i] = _mm512_fmadd_ps(w, v[i], sums[g][i]);
    }
  }
#pragma GCC unroll 4
  for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 4
    for (int64_t i = 0; i < 4; ++i) _mm512_storeu_ps(acc + g * head_dim + 16 * i, sums[g][i]);
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// AVX2, a group of up to 3 query heads: head_dim in chunks of 32, the group's 4 accumulators
// a chunk in registers (12 of the 16), where the portable loop's chunks of 16 walk the block
// twice as often, each key's weights broadcast once a chunk. Each accumulator lane takes its
// fmadds in the portable loop's order: the same bits.
constexpr int64_t kAvx2ValueChunk = 32;

inline bool avx2_values_fit(int64_t head_dim, int64_t group) {
  return head_dim % kAvx2ValueChunk == 0 && group <= 3;
}

template <typename T, int64_t G>
void weigh_values_avx2(const T* values, int64_t n, int64_t head_dim, const float* weights,
                       int64_t block_size, float* acc, const T* next_keys,
                       const T* next_values) {
  for (int64_t d = 0; d < head_dim; d += kAvx2ValueChunk) {
    __m256 sums[G][4];
#pragma GCC unroll 3
    for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 4
      for (int64_t i = 0; i < 4; ++i) sums[g][i] = _mm256_loadu_ps(acc + g * head_dim + d + 8 * i);
    }
    for (int64_t t = 0; t < n; ++t) {
      if (d == 0 && next_keys != nullptr) {
        prefetch_rows(next_keys, t, t + 1, head_dim);
        prefetch_rows_l2(next_values, t, t + 1, head_dim);
      }
      const T* row = values + t * head_dim + d;
#pragma GCC unroll 3
      for (int64_t g = 0; g < G; ++g) {
        const __m256 w = _mm256_broadcast_ss(weights + g * block_size + t);
#pragma GCC unroll 4
        for (int64_t i = 0; i < 4; ++i) {
          sums[g][i] = _mm256_fmadd_ps(w, load8(row + 8 * i), sums[g][i]);
        }
      }
    }
#pragma GCC unroll 3
    for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 4
      for (int64_t i = 0; i < 4; ++i) _mm256_storeu_ps(acc + g * head_dim + d + 8 * i, sums[g][i]);
    }
  }
}
#endif

// fast: the AVX2 pass may run (off with the portable score loop, so that the tests compare
// both AVX2 loops' bits with the portable ones'; AVX-512's, other bits, run either way).
template <typename T, int64_t G>
void weigh_values(const T* values, int64_t n, int64_t head_dim, const float* weights,
                  int64_t block_size, float* acc, const T* next_keys, const T* next_values,
                  bool fast) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (G <= 4) {
    if (two_chunk_values(head_dim, G)) {
      weigh_two_chunks<T, G>(values, n, weights, block_size, acc, next_keys, next_values);
      return;
    }
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (G <= 3) {
    if (fast && avx2_values_fit(head_dim, G)) {
      weigh_values_avx2<T, G>(values, n, head_dim, weights, block_size, acc, next_keys,
                              next_values);
      return;
    }
  }
#endif
  for (int64_t d = 0; d < head_dim; d += kChunk) {
    const int64_t width = std::min(kChunk, head_dim - d);
    Vec acc_lo[G], acc_hi[G];
    for (int64_t g = 0; g < G; ++g) {
      load_chunk(acc + g * head_dim + d, width, acc_lo[g], acc_hi[g]);
    }
    for (int64_t t = 0; t < n; ++t) {
      if (d == 0 && next_keys != nullptr) {
        prefetch_rows(next_keys, t, t + 1, head_dim);
        prefetch_rows_l2(next_values, t, t + 1, head_dim);
      }
      Vec lo, hi;
      load_chunk(values + t * head_dim + d, width, lo, hi);
      for (int64_t g = 0; g < G; ++g) {
        const Vec w(weights[g * block_size + t]);
        acc_lo[g] = at::vec::fmadd(w, lo, acc_lo[g]);
        acc_hi[g] = at::vec::fmadd(w, hi, acc_hi[g]);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      store_chunk(acc_lo[g], acc_hi[g], width, acc + g * head_dim + d);
    }
  }
}

// One decode row of one KV head through a sequence task: its queries, accumulators and
// running softmax statistics, carried across the blocks.
template <typename T>
struct RowState {
  const T* q;  // the row's first query head of this KV head, stride q_head_stride
  const int64_t* blocks;
  int64_t num_blocks;
  int64_t context_len;
  T* out;  // the row's first output head of this KV head (contiguous heads)
  float* query;  // [group, head_dim] scaled (the portable score loop's input)
  float* acc;    // [group, head_dim]
  float running_max[kMaxGroup];
  float running_sum[kMaxGroup];
};

template <typename T>
void start_row(RowState<T>& row, int64_t q_head_stride, int64_t head_dim, int64_t group,
               float scale) {
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < head_dim; d += kChunk) {
      const int64_t width = std::min(kChunk, head_dim - d);
      Vec lo, hi;
      load_chunk(row.q + g * q_head_stride + d, width, lo, hi);
      store_chunk(lo * Vec(scale), hi * Vec(scale), width, row.query + g * head_dim + d);
    }
  }
  std::fill_n(row.acc, group * head_dim, 0.f);
  std::fill_n(row.running_max, group, -std::numeric_limits<float>::infinity());
  std::fill_n(row.running_sum, group, 0.f);
}

// Block b of a row's list into its running softmax and accumulators; `next_keys` (or null)
// and its value tile are prefetched while the values are weighed.
template <typename T>
void attend_block(
    RowState<T>& row,
    int64_t b,
    int64_t q_head_stride,
    const T* key_cache,
    const T* value_cache,
    int64_t kv_head,
    int64_t kv_heads,
    int64_t block_size,
    int64_t head_dim,
    int64_t group,
    float scale,
    bool fast_scores,
    const T* next_keys,
    float* scores) {  // [group, block_size] scratch: one block's scores, then weights
  const int64_t tile = block_size * head_dim;
  const T* next_values = next_keys != nullptr ? value_cache + (next_keys - key_cache) : nullptr;
  const int64_t n = std::min(block_size, row.context_len - b * block_size);
  const int64_t offset = (row.blocks[b] * kv_heads + kv_head) * tile;
  const T* keys = key_cache + offset;
  const T* values = value_cache + offset;
  float* acc = row.acc;
#if defined(CPU_CAPABILITY_AVX512)
  if (fast_scores) {
    block_scores_avx512(
        row.q, q_head_stride, keys, values, n, head_dim, group, scale, scores, block_size);
  } else
#endif
#if defined(CPU_CAPABILITY_AVX2)
  if (fast_scores) {
    block_scores_avx2(row.query, keys, values, n, head_dim, group, scores, block_size);
  } else
#endif
  {
    block_scores(row.query, keys, values, n, head_dim, group, scores, block_size);
  }
  for (int64_t g = 0; g < group; ++g) {
    float* weights = scores + g * block_size;
    const float block_max = max_of(weights, n);
    const float new_max = std::max(row.running_max[g], block_max);
    // exp(-inf) = 0 clears the empty accumulator on a row's first block.
    const float rescale = std::exp(row.running_max[g] - new_max);
    row.running_sum[g] = row.running_sum[g] * rescale + exp_and_sum(weights, n, new_max);
    row.running_max[g] = new_max;
    if (rescale != 1.f) {
      float* a = acc + g * head_dim;
      at::vec::map([rescale](Vec x) { return x * Vec(rescale); }, a, a, head_dim);
    }
  }
  // The group size as a template argument: weigh_values keeps its accumulators in registers.
  const auto weigh = [&](auto size) {
    weigh_values<T, decltype(size)::value>(values, n, head_dim, scores, block_size, acc,
                                           next_keys, next_values, fast_scores);
  };
  switch (group) {
    case 1: weigh(std::integral_constant<int64_t, 1>{}); break;
    case 2: weigh(std::integral_constant<int64_t, 2>{}); break;
    case 3: weigh(std::integral_constant<int64_t, 3>{}); break;
    case 4: weigh(std::integral_constant<int64_t, 4>{}); break;
    case 5: weigh(std::integral_constant<int64_t, 5>{}); break;
    case 6: weigh(std::integral_constant<int64_t, 6>{}); break;
    case 7: weigh(std::integral_constant<int64_t, 7>{}); break;
    default: weigh(std::integral_constant<int64_t, kMaxGroup>{});
  }
}

template <typename T>
void finish_row(const RowState<T>& row, int64_t head_dim, int64_t group) {
#if defined(CPU_CAPABILITY_AVX512)
  const bool interleaved =
      std::is_same_v<T, at::BFloat16> && two_chunk_values(head_dim, group);
#else
  const bool interleaved = false;
#endif
  for (int64_t g = 0; g < group; ++g) {
    const Vec inverse(1.f / row.running_sum[g]);
    for (int64_t d = 0; d < head_dim; d += kChunk) {
      const int64_t width = std::min(kChunk, head_dim - d);
      Vec lo, hi;
      load_chunk(row.acc + g * head_dim + d, width, lo, hi);
#if defined(CPU_CAPABILITY_AVX512)
      if (interleaved) interleave_dims(lo, hi);
#endif
      store_chunk(lo * inverse, hi * inverse, width, row.out + g * head_dim + d);
    }
  }
}

// One sequence's decode rows (one row, or a draft's verify rows: consecutive positions over
// the same blocks) for one KV head. Blocks are the outer loop: a block's K/V tile comes from
// memory for the sequence's first row that reads it and from the CPU's caches for the rest,
// where one task per row would fetch it once per row. Each row still meets its own blocks in
// order with the same arithmetic, so its bits do not depend on the rows beside it.
template <typename T>
void sequence_task(
    std::vector<RowState<T>>& rows,
    int64_t q_head_stride,
    const T* key_cache,
    const T* value_cache,
    int64_t kv_head,
    int64_t kv_heads,
    int64_t block_size,
    int64_t head_dim,
    int64_t group,
    float scale,
    bool fast_scores,
    const T* following,  // the first key tile of this thread's next task, or null
    std::vector<float>& scratch) {
  const int64_t count = static_cast<int64_t>(rows.size());
  const int64_t per_row = 2 * group * head_dim;
  scratch.resize(count * per_row + group * block_size);
  float* scores = scratch.data() + count * per_row;
  int64_t max_blocks = 0;
  const RowState<T>* longest = &rows[0];
  for (int64_t r = 0; r < count; ++r) {
    rows[r].query = scratch.data() + r * per_row;
    rows[r].acc = rows[r].query + group * head_dim;
    start_row(rows[r], q_head_stride, head_dim, group, scale);
    if (rows[r].num_blocks > max_blocks) {
      max_blocks = rows[r].num_blocks;
      longest = &rows[r];
    }
  }
  const int64_t tile = block_size * head_dim;
  for (int64_t b = 0; b < max_blocks; ++b) {
    const T* next_keys =
        b + 1 < max_blocks ? key_cache + (longest->blocks[b + 1] * kv_heads + kv_head) * tile
                           : following;
    bool first = true;
    for (auto& row : rows) {
      if (b >= row.num_blocks) continue;
      attend_block(row, b, q_head_stride, key_cache, value_cache, kv_head, kv_heads,
                   block_size, head_dim, group, scale, fast_scores,
                   first ? next_keys : nullptr, scores);
      first = false;
    }
  }
  for (const auto& row : rows) finish_row(row, head_dim, group);
}

// One (sequence, KV head) task of decode_all's: the sequence's rows [first, last) laid out
// in `states`, then sequence_task; `following` as there.
template <typename T>
void row_task(
    const T* q_data,
    int64_t q_row,
    int64_t q_head,
    int64_t heads,
    int64_t head_dim,
    const T* k_data,
    const T* v_data,
    int64_t kv_heads,
    int64_t block_size,
    const int64_t* ids,
    const int64_t* starts,
    const int64_t* lens,
    int64_t first,
    int64_t last,
    int64_t kv_head,
    float scale,
    bool fast_scores,
    const T* following,
    T* out_data,
    std::vector<RowState<T>>& states,
    std::vector<float>& scratch) {
  const int64_t group = heads / kv_heads;
  states.resize(last - first);
  for (int64_t row = first; row < last; ++row) {
    auto& state = states[row - first];
    state.q = q_data + row * q_row + kv_head * group * q_head;
    state.blocks = ids + starts[row];
    state.num_blocks = starts[row + 1] - starts[row];
    state.context_len = lens[row];
    state.out = out_data + (row * heads + kv_head * group) * head_dim;
  }
  sequence_task<T>(states, q_head, k_data, v_data, kv_head, kv_heads, block_size, head_dim,
                   group, scale, fast_scores, following, scratch);
}

// seq_starts [sequences + 1]: sequence s holds rows [seq_starts[s], seq_starts[s + 1]);
// null: every row is its own sequence.
template <typename T>
void decode_all(
    const T* q_data,
    int64_t q_row,
    int64_t q_head,
    int64_t rows,
    int64_t heads,
    int64_t head_dim,
    const T* k_data,
    const T* v_data,
    int64_t kv_heads,
    int64_t block_size,
    const int64_t* ids,
    const int64_t* starts,
    const int64_t* lens,
    const int64_t* seq_starts,
    int64_t sequences,
    float scale,
    bool fast_scores,
    T* out_data) {
  const int64_t tasks = sequences * kv_heads;
  // Sequences have ragged contexts and row counts: hand out (sequence, KV head) tasks one
  // at a time, or, with a few sequences a thread, a sequence's KV heads together, so that a
  // task knows its thread's next one and fetches that one's first block ahead.
  const int64_t chunk = sequences >= 2 * at::get_num_threads() ? kv_heads : 1;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> scratch;
    std::vector<RowState<T>> states;
#pragma omp for schedule(dynamic, chunk)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t seq = task / kv_heads, kv_head = task % kv_heads;
      const int64_t first = seq_starts ? seq_starts[seq] : seq;
      const int64_t last = seq_starts ? seq_starts[seq + 1] : seq + 1;
      const T* following = nullptr;
      if (chunk > 1 && kv_head + 1 < kv_heads) {
        following = k_data + (ids[starts[first]] * kv_heads + kv_head + 1) * block_size * head_dim;
      }
      row_task<T>(q_data, q_row, q_head, heads, head_dim, k_data, v_data, kv_heads, block_size,
                  ids, starts, lens, first, last, kv_head, scale, fast_scores, following,
                  out_data, states, scratch);
    }
  }
}

template <typename T>
bool use_fast_scores(int64_t head_dim, bool portable) {
#if defined(CPU_CAPABILITY_AVX512)
  return !portable && fast_scores_fit(static_cast<const T*>(nullptr), head_dim);
#elif defined(CPU_CAPABILITY_AVX2)
  return !portable && avx2_scores_fit(head_dim);
#else
  return false;
#endif
}

}  // namespace

void deepwell::check_block_lists(
    const int64_t* id,
    int64_t num_ids,
    const int64_t* start,
    const int64_t* len,
    int64_t rows,
    int64_t num_blocks,
    int64_t block_size) {
  TORCH_CHECK(start[0] == 0 && start[rows] == num_ids,
              "block_starts must run from 0 to the number of block ids");
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t count = start[row + 1] - start[row];
    const int64_t needed = (len[row] + block_size - 1) / block_size;
    TORCH_CHECK(len[row] >= 1 && count == needed, "row ", row, ": context length ", len[row],
                " needs ", needed, " blocks, it has ", count);
  }
  for (int64_t i = 0; i < num_ids; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_blocks, "block id ", id[i], " is out of the cache");
  }
}

void deepwell::paged_decode_heads(
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
    void* out,
    int64_t kv_begin,
    int64_t kv_end) {
  const int64_t kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t head_dim = key_cache.size(3);
  // Per thread, reused: the whole-step decoder calls this once per layer.
  thread_local std::vector<float> scratch;
  const auto each_task = [&](auto* q_data, auto* k_data, auto* v_data, auto* out_data) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(k_data)>>;
    thread_local std::vector<RowState<T>> states;
    const bool fast = use_fast_scores<T>(head_dim, false);
    for (int64_t row = 0; row < rows; ++row) {
      for (int64_t kv_head = kv_begin; kv_head < kv_end; ++kv_head) {
        // The row's next head's first key tile, fetched ahead as decode_all's chunks do.
        const T* following = kv_head + 1 < kv_end
            ? k_data + (ids[starts[row]] * kv_heads + kv_head + 1) * block_size * head_dim
            : nullptr;
        row_task<T>(q_data, q_row, head_dim, heads, head_dim, k_data, v_data, kv_heads,
                    block_size, ids, starts, lens, row, row + 1, kv_head, scale, fast, following,
                    out_data, states, scratch);
      }
    }
  };
  if (key_cache.scalar_type() == at::kBFloat16) {
    each_task(static_cast<const at::BFloat16*>(q), key_cache.data_ptr<at::BFloat16>(),
              value_cache.data_ptr<at::BFloat16>(), static_cast<at::BFloat16*>(out));
  } else {
    each_task(static_cast<const float*>(q), key_cache.data_ptr<float>(),
              value_cache.data_ptr<float>(), static_cast<float*>(out));
  }
}

// portable: the portable score loop even where the AVX-512 one fits (so that tests on an
// AVX-512 machine cover the path other CPUs run), and the portable value pass where the
// AVX2 loops would run (so that tests compare their bits).
// q [rows, heads, head_dim] (head_dim contiguous); caches contiguous
// [num_blocks, kv_heads, block_size, head_dim]; block_ids: every row's blocks, row by row;
// block_starts [rows + 1]: where each row's blocks begin in block_ids; context_lens [rows];
// sequence_starts [sequences + 1]: where each sequence's rows begin (a draft's verify rows are
// one sequence's, read together block by block).
at::Tensor paged_decode(
    const at::Tensor& q,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& block_ids,
    const at::Tensor& block_starts,
    const at::Tensor& context_lens,
    const at::Tensor& sequence_starts,
    double scale,
    bool portable) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [rows, heads, head_dim]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type() &&
                  q.scalar_type() == value_cache.scalar_type(),
              "q and the caches must share a dtype");
  const int64_t heads = q.size(1), head_dim = q.size(2), kv_heads = key_cache.size(1);
  TORCH_CHECK(key_cache.size(3) == head_dim, "head_dim of q and the caches differ");
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup,
              "query heads per KV head must divide evenly and be at most ", kMaxGroup);
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_starts.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong &&
                  sequence_starts.scalar_type() == at::kLong,
              "block_ids, block_starts, context_lens and sequence_starts must be int64");
  TORCH_CHECK(block_starts.numel() == q.size(0) + 1 && context_lens.numel() == q.size(0),
              "one block start per row plus one, one context length per row");
  // The block lists are checked whole before any is read: a bad one is an error, never a
  // read outside the cache.
  const auto ids = block_ids.contiguous(), starts = block_starts.contiguous(),
             lens = context_lens.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  deepwell::check_block_lists(id, ids.numel(), start, len, q.size(0), key_cache.size(0),
                              key_cache.size(2));
  const auto seq_starts = sequence_starts.contiguous();
  const int64_t* seq = seq_starts.data_ptr<int64_t>();
  const int64_t sequences = seq_starts.numel() - 1;
  TORCH_CHECK(sequences >= 0 && seq[0] == 0 && seq[sequences] == q.size(0),
              "sequence_starts must run from 0 to the number of rows");
  for (int64_t s = 0; s < sequences; ++s) {
    TORCH_CHECK(seq[s + 1] > seq[s], "sequence ", s, " has no rows");
  }
  auto out = at::empty({q.size(0), heads, head_dim}, q.options());
  const int64_t rows = q.size(0), block_size = key_cache.size(2);
  if (q.scalar_type() == at::kBFloat16) {
    decode_all<at::BFloat16>(q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1), rows, heads,
                             head_dim, key_cache.data_ptr<at::BFloat16>(),
                             value_cache.data_ptr<at::BFloat16>(), kv_heads, block_size, id, start,
                             len, seq, sequences, static_cast<float>(scale),
                             use_fast_scores<at::BFloat16>(head_dim, portable),
                             out.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "the kernel takes bfloat16 or float32");
    decode_all<float>(q.data_ptr<float>(), q.stride(0), q.stride(1), rows, heads, head_dim,
                      key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), kv_heads,
                      block_size, id, start, len, seq, sequences, static_cast<float>(scale),
                      use_fast_scores<float>(head_dim, portable), out.data_ptr<float>());
  }
  return out;
}

// The step's new keys and values into their slots: token i's row of each KV head goes to
// block slot_blocks[i] at offset slot_offsets[i]. One copy per (token, KV head) row;
// advanced-indexing assignment (cache[blocks, :, offsets] = k) measured ~0.2 ms a call in
// W's decode steps for 64 rows.
// Below this many tokens a store runs on the calling thread: a decode step's rows are a few
// KB, less than waking the other threads costs.
constexpr int64_t kStoreGrainTokens = 256;

void paged_store(
    const at::Tensor& k,
    const at::Tensor& v,
    at::Tensor& key_cache,
    at::Tensor& value_cache,
    const at::Tensor& slot_blocks,
    const at::Tensor& slot_offsets) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v rows must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  TORCH_CHECK(k.scalar_type() == key_cache.scalar_type() && v.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "k, v and the caches must share a dtype");
  TORCH_CHECK(key_cache.size(1) == k.size(1) && key_cache.size(3) == k.size(2),
              "kv_heads and head_dim of k and the caches differ");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.numel() == k.size(0) && slot_offsets.numel() == k.size(0),
              "one int64 slot block and offset per token");
  const int64_t tokens = k.size(0), kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(2);
  const int64_t row_bytes = head_dim * k.element_size();
  const auto blocks = slot_blocks.contiguous(), offsets = slot_offsets.contiguous();
  const int64_t* block = blocks.data_ptr<int64_t>();
  const int64_t* offset = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens; ++i) {
    TORCH_CHECK(block[i] >= 0 && block[i] < num_blocks && offset[i] >= 0 && offset[i] < block_size,
                "slot out of the cache");
  }
  const char* k_data = static_cast<const char*>(k.data_ptr());
  const char* v_data = static_cast<const char*>(v.data_ptr());
  char* key_data = static_cast<char*>(key_cache.data_ptr());
  char* value_data = static_cast<char*>(value_cache.data_ptr());
  const int64_t element = k.element_size();
  // A prefill chunk's rows are the first writes to fresh blocks, whose pages fault in as they
  // are touched (kv/cache.py): long chunks split them over the threads.
  at::parallel_for(0, tokens, kStoreGrainTokens, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t row = ((block[i] * kv_heads + h) * block_size + offset[i]) * row_bytes;
        std::memcpy(key_data + row, k_data + (i * k.stride(0) + h * k.stride(1)) * element, row_bytes);
        std::memcpy(value_data + row, v_data + (i * v.stride(0) + h * v.stride(1)) * element, row_bytes);
      }
    }
  });
}

// In the one extension of several sources (decode_kernel.py), llama_decode.cpp's module is
// the extension's.
#if !defined(DEEPWELL_ONE_EXTENSION)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_store", &paged_store, "store a step's K/V rows in their cache slots (CPU)");
  m.def("paged_decode", &paged_decode, "fused paged-attention decode (CPU)");
  m.def("fast_scores", [](bool bf16, int64_t head_dim) {
    return bf16 ? use_fast_scores<at::BFloat16>(head_dim, false)
                : use_fast_scores<float>(head_dim, false);
  }, "whether the AVX-512 score loop runs for this dtype and head_dim");
}
#endif
