// Decode linears on GGUF blocks: Q4_1 or Q8_0 weights times activations quantised per
// 32-block to int8 (llama.cpp's q8_1), for calls of a few rows; built by decode_kernel.py.
//
// Weight layout (repacked at load by layers/quant_linear.py), row-interleaved: output
// features in tiles of 16 (the last padded with zero rows), each tile one stream of its B
// blocks of 32 inputs, every block of the tile stored as
//   Q4_1 (w = d q + m, q in 0..15), 320 bytes: 4 vectors of 64 bytes, byte 4o + j of vector
//         v = q[o][4v + j] | q[o][16 + 4v + j] << 4 (o the tile's output, j 0..3), then fp16
//         d[16], then fp16 m[16];
//   Q8_0 (w = d q, q int8), 576 bytes: 8 vectors of 64 bytes, byte 4o + j of vector g =
//         q[o][4g + j], then fp16 d[16], then int16 Σq[16], for the VNNI path, which
//         multiplies q by x + 128 (unsigned) and takes 128 Σq back out in int32.
// So one 64-byte vector holds 4 inputs of each of 16 outputs, the order vpdpbusd sums in:
// 4 activation bytes broadcast against it add to 16 outputs' int32 lanes at once, and the
// tile's 16 lanes are its 16 outputs (no horizontal sums). A 32-byte half is 8 outputs, the
// AVX2 path's vector. The scales are GGUF's fp16: a decode step streams every weight, and
// bytes are its time.
// Activations: per row and block, dx = amax / 127, qx = round(x / dx), sx = dx * Σ qx; then
//   Q4_1: Σ w x ≈ d dx Σ q qx + m sx,   Q8_0: Σ w x ≈ d dx Σ q qx,
// with the integer sums exact in int32 and the rest in float32 (the d dx terms and the
// m sx terms summed over blocks apart, then added).
//
// The instruction set is fixed at compile time: AVX-512 VNNI (vpdpbusd: 64 u8 × s8 products
// summed in fours into 16 int32 lanes), else AVX2 (vpmaddubsw + vpmaddwd), else scalar C++.
// DEEPWELL_QUANT_AVX2 / DEEPWELL_QUANT_SCALAR force the lower paths (tests build each).

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include "kernel_parts.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if !defined(DEEPWELL_QUANT_SCALAR) && !defined(DEEPWELL_QUANT_AVX2) && \
    defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QUANT_VNNI 1
#elif !defined(DEEPWELL_QUANT_SCALAR) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_AVX2 1
#endif

#if defined(QUANT_VNNI) || defined(QUANT_AVX2)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = deepwell::kTileOutputs;
// One block of one tile: Q4_1 16 × (16 nibble bytes, fp16 d, fp16 m); Q8_0 16 × (32 int8,
// fp16 d, int16 Σq).
constexpr int64_t kQ4_1TileBlock = kTile * deepwell::kQ4_1BlockBytes;  // 320
constexpr int64_t kQ8_0TileBlock = kTile * deepwell::kQ8_0BlockBytes;  // 576
constexpr int64_t kQ4_1Quants = kTile * kBlock / 2;  // 256
constexpr int64_t kQ8_0Quants = kTile * kBlock;  // 512

inline float half_to_float(const uint8_t* bytes) {
  uint16_t bits;
  std::memcpy(&bits, bytes, sizeof bits);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline int32_t load_int32(const void* bytes) {
  int32_t value;
  std::memcpy(&value, bytes, sizeof value);
  return value;
}

using deepwell::kMaxRows;

struct Activations {
  int64_t blocks = 0;
  std::vector<int8_t> q;  // [rows, B * 32]
  std::vector<float> d;  // [rows, B]
  std::vector<float> s;  // [rows, B]: d * Σ q
#if defined(QUANT_VNNI)
  std::vector<uint8_t> unsigned_q;  // q + 128, for Q8_0 weights (s8) on vpdpbusd's u8 side
#endif
};

// A block's 32 activations as float32.
inline void block_values(const float* src, float* values) { std::memcpy(values, src, kBlock * sizeof(float)); }

inline void block_values(const at::BFloat16* src, float* values) {
  for (int64_t j = 0; j < kBlock; ++j) values[j] = static_cast<float>(src[j]);
}

// One block: q = round(v / d) (ties to even, the default rounding mode, as torch.round in the
// tests' reference) with d = amax / 127, then (d, Σ q). The vector paths do the same float32
// operations lane by lane (the max, the product by 1 / d, the rounding), so every path
// gives the same bytes; they run once per linear on one thread while the others wait, so
// they are on a batch-1 step's critical path.
inline std::pair<float, int32_t> quantize_block(const float* values, int8_t* q) {
#if defined(QUANT_VNNI)
  const __m512 lo = _mm512_loadu_ps(values), hi = _mm512_loadu_ps(values + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
#else
  float amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::abs(values[j]));
#endif
  const float d = amax / 127.f;
  const float inverse = d > 0.f ? 1.f / d : 0.f;
#if defined(QUANT_VNNI)
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 scale = _mm512_set1_ps(inverse);
  const __m512i q_lo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(lo, scale), kNearest));
  const __m512i q_hi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(hi, scale), kNearest));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q_lo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q_hi));
  return {d, _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi))};
#elif defined(QUANT_AVX2)
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 scale = _mm256_set1_ps(inverse);
  alignas(32) int32_t rounded[kBlock];
  for (int64_t j = 0; j < kBlock; j += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(values + j), scale);
    _mm256_store_si256(reinterpret_cast<__m256i*>(rounded + j), _mm256_cvtps_epi32(_mm256_round_ps(v, kNearest)));
  }
  int32_t sum = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(rounded[j]);
    sum += rounded[j];
  }
  return {d, sum};
#else
  int32_t sum = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(values[j] * inverse));
    sum += q[j];
  }
  return {d, sum};
#endif
}

// Per row and block, llama.cpp's q8_1: dx = amax / 127, qx = round(x / dx), sx = dx Σ qx.
// Into one buffer per thread, reused: a batch-1 step quantises 121 activations.
template <typename T>
const Activations& quantize_activations(const T* x, int64_t rows, int64_t in_features) {
  thread_local Activations a;
  const int64_t blocks = in_features / kBlock;
  a.blocks = blocks;
  a.q.resize(rows * blocks * kBlock);
  a.d.resize(rows * blocks);
  a.s.resize(rows * blocks);
#if defined(QUANT_VNNI)
  a.unsigned_q.resize(a.q.size());
#endif
  float values[kBlock];
  for (int64_t at = 0; at < rows * blocks; ++at) {
    block_values(x + at * kBlock, values);
    int8_t* q = a.q.data() + at * kBlock;
    const auto [d, sum] = quantize_block(values, q);
    a.d[at] = d;
    a.s[at] = d * static_cast<float>(sum);
#if defined(QUANT_VNNI)
    // q + 128, for Q8_0's signed weights on vpdpbusd's unsigned side.
    const __m256i flipped = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)),
                                             _mm256_set1_epi8(static_cast<char>(0x80)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.unsigned_q.data() + at * kBlock), flipped);
#endif
  }
  return a;
}

// Stores a tile's 16 (or, the last tile, fewer) outputs of each row, or adds them to out's
// values where `add` (the whole-step decoder's residuals: x + sum, as a separate add rounds).
inline void store_tile(const float* sums, int64_t rows, int64_t first, int64_t out_features,
                       bool add, float* out) {
  const int64_t count = std::min<int64_t>(kTile, out_features - first);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = out + r * out_features + first;
    if (add) {
      for (int64_t i = 0; i < count; ++i) row[i] += sums[r * kTile + i];
    } else {
      std::memcpy(row, sums + r * kTile, count * sizeof(float));
    }
  }
}

#if defined(QUANT_VNNI) || defined(QUANT_AVX2)
// Bytes ahead of the block being read that are prefetched into L2: the weights stream from
// memory once a step, and a tile's blocks (a thread's tiles) are one contiguous run. Into L2,
// not L1: a prefetch to L1 holds one of the core's few line-fill buffers until its line
// arrives, which capped one thread at ~7 GB/s; measured (one thread, one step's linears of
// SmolLM2, /tmp A/B at 2, 4, 8, 32 and 64 KB): L1 at 2 KB 9.2 ms, L2 at 4-64 KB 5.4-6.0 ms
// within the machine's noise, 8 KB the middle.
constexpr int64_t kPrefetchBytes = 8192;

inline void prefetch_block(const uint8_t* w, int64_t block_bytes) {
  for (int64_t line = 0; line < block_bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + line), _MM_HINT_T1);
  }
}
#endif

#if defined(QUANT_VNNI)

// Tiles [begin, end) for R activation rows. Per block and row: the int32 sums of the
// tile's 16 outputs in two chains (Q4_1: inputs 0-15 and 16-31, the low and high nibbles;
// Q8_0: even and odd groups of 4 inputs; two, to hide vpdpbusd's latency), one
// fma of d dx into the row's float lanes, and for Q4_1 one fma of m sx into a second set.
template <int R, bool kQ4_1>
void tiles(const uint8_t* weights, const Activations& a, int64_t begin, int64_t end,
           int64_t out_features, bool add, float* out) {
  const int64_t blocks = a.blocks;
  const int64_t block_bytes = kQ4_1 ? kQ4_1TileBlock : kQ8_0TileBlock;
  const int64_t quant_bytes = kQ4_1 ? kQ4_1Quants : kQ8_0Quants;
  const __m512i low = _mm512_set1_epi8(0x0F);
  // 4 activation bytes as one int32 to broadcast: 8 per block.
  const uint8_t* x_bytes = kQ4_1 ? reinterpret_cast<const uint8_t*>(a.q.data()) : a.unsigned_q.data();
  alignas(64) float sums[R * kTile];
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* tile = weights + t * blocks * block_bytes;
    __m512 acc[R], offsets[R];
    for (int r = 0; r < R; ++r) acc[r] = offsets[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* w = tile + b * block_bytes;
      prefetch_block(w, block_bytes);
      const uint8_t* x = x_bytes + b * kBlock;
      __m512i first[R], second[R];
      for (int r = 0; r < R; ++r) first[r] = second[r] = _mm512_setzero_si512();
      if constexpr (kQ4_1) {
        for (int v = 0; v < 4; ++v) {
          const __m512i packed = _mm512_loadu_si512(w + 64 * v);
          const __m512i w_low = _mm512_and_si512(packed, low);
          const __m512i w_high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
          for (int r = 0; r < R; ++r) {
            const uint8_t* xr = x + r * blocks * kBlock;
            first[r] = _mm512_dpbusd_epi32(first[r], w_low, _mm512_set1_epi32(load_int32(xr + 4 * v)));
            second[r] = _mm512_dpbusd_epi32(second[r], w_high, _mm512_set1_epi32(load_int32(xr + 16 + 4 * v)));
          }
        }
      } else {
        for (int g = 0; g < 8; g += 2) {
          const __m512i w0 = _mm512_loadu_si512(w + 64 * g);
          const __m512i w1 = _mm512_loadu_si512(w + 64 * (g + 1));
          for (int r = 0; r < R; ++r) {
            const uint8_t* xr = x + r * blocks * kBlock;
            // vpdpbusd takes its first operand unsigned: Q8_0's x + 128 here.
            first[r] = _mm512_dpbusd_epi32(first[r], _mm512_set1_epi32(load_int32(xr + 4 * g)), w0);
            second[r] = _mm512_dpbusd_epi32(second[r], _mm512_set1_epi32(load_int32(xr + 4 * g + 4)), w1);
          }
        }
      }
      const uint8_t* scales = w + quant_bytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
      const __m256i extra = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 2 * kTile));
      if constexpr (kQ4_1) {
        const __m512 m = _mm512_cvtph_ps(extra);
        for (int r = 0; r < R; ++r) {
          const int64_t at = r * blocks + b;
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(first[r], second[r]));
          acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(a.d[at])), acc[r]);
          offsets[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.s[at]), offsets[r]);
        }
      } else {
        // Σ q (qx + 128) - 128 Σq, exact in int32.
        const __m512i bias = _mm512_slli_epi32(_mm512_cvtepi16_epi32(extra), 7);
        for (int r = 0; r < R; ++r) {
          const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(first[r], second[r]), bias);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(a.d[r * blocks + b])), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm512_store_ps(sums + r * kTile, _mm512_add_ps(acc[r], offsets[r]));
    store_tile(sums, R, t * kTile, out_features, add, out);
  }
}

#elif defined(QUANT_AVX2)

// u8 × s8 products of 32 lanes summed in pairs into 16 int16 lanes. Neither operand here
// reaches vpmaddubsw's int16 saturation: |u| ≤ 127 and |s| ≤ 127.
inline __m256i pair_sums(__m256i u, __m256i s) { return _mm256_maddubs_epi16(u, s); }

inline __m256i quad_sums(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }

// Tiles [begin, end) for R activation rows, each tile as two halves of 8 outputs (a 32-byte
// half of every 64-byte vector), the half's R × 2 accumulators in registers.
template <int R, bool kQ4_1>
void tiles(const uint8_t* weights, const Activations& a, int64_t begin, int64_t end,
           int64_t out_features, bool add, float* out) {
  const int64_t blocks = a.blocks;
  const int64_t block_bytes = kQ4_1 ? kQ4_1TileBlock : kQ8_0TileBlock;
  const int64_t quant_bytes = kQ4_1 ? kQ4_1Quants : kQ8_0Quants;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const uint8_t* x_bytes = reinterpret_cast<const uint8_t*>(a.q.data());
  alignas(32) float sums[R * kTile];
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* tile = weights + t * blocks * block_bytes;
    for (int half = 0; half < 2; ++half) {
      __m256 acc[R], offsets[R];
      for (int r = 0; r < R; ++r) acc[r] = offsets[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* w = tile + b * block_bytes + 32 * half;
        if (half == 0) prefetch_block(w, block_bytes);
        const uint8_t* x = x_bytes + b * kBlock;
        __m256i dots[R];
        if constexpr (kQ4_1) {
          // The 8 pair sums of a block add up in int16: 8 × 2 × 15 × 127 = 30480 < 32768.
          __m256i pairs[R];
          for (int r = 0; r < R; ++r) pairs[r] = _mm256_setzero_si256();
          for (int v = 0; v < 4; ++v) {
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * v));
            const __m256i w_low = _mm256_and_si256(packed, low);
            const __m256i w_high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
            for (int r = 0; r < R; ++r) {
              const uint8_t* xr = x + r * blocks * kBlock;
              pairs[r] = _mm256_add_epi16(pairs[r], pair_sums(w_low, _mm256_set1_epi32(load_int32(xr + 4 * v))));
              pairs[r] = _mm256_add_epi16(pairs[r], pair_sums(w_high, _mm256_set1_epi32(load_int32(xr + 16 + 4 * v))));
            }
          }
          for (int r = 0; r < R; ++r) dots[r] = quad_sums(pairs[r]);
        } else {
          // |w| × (x with w's sign): x + 128 against signed w would saturate vpmaddubsw.
          for (int r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
          for (int g = 0; g < 8; ++g) {
            const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * g));
            const __m256i magnitude = _mm256_abs_epi8(wv);
            for (int r = 0; r < R; ++r) {
              const __m256i xv = _mm256_set1_epi32(load_int32(x + r * blocks * kBlock + 4 * g));
              dots[r] = _mm256_add_epi32(dots[r], quad_sums(pair_sums(magnitude, _mm256_sign_epi8(xv, wv))));
            }
          }
        }
        const uint8_t* scales = tile + b * block_bytes + quant_bytes + 16 * half;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
        for (int r = 0; r < R; ++r) {
          const int64_t at = r * blocks + b;
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_mul_ps(d, _mm256_set1_ps(a.d[at])), acc[r]);
        }
        if constexpr (kQ4_1) {
          const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 2 * kTile)));
          for (int r = 0; r < R; ++r) {
            offsets[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s[r * blocks + b]), offsets[r]);
          }
        }
      }
      for (int r = 0; r < R; ++r) _mm256_store_ps(sums + r * kTile + 8 * half, _mm256_add_ps(acc[r], offsets[r]));
    }
    store_tile(sums, R, t * kTile, out_features, add, out);
  }
}

#else

// Weight q of the tile's output o, input i of the block at w (the layout above).
template <bool kQ4_1>
inline int32_t weight_at(const uint8_t* w, int64_t o, int64_t i) {
  const int64_t group = i / 4, j = i % 4;
  if constexpr (kQ4_1) {
    return (w[64 * (group % 4) + 4 * o + j] >> (group / 4 * 4)) & 0x0F;
  } else {
    return static_cast<int8_t>(w[64 * group + 4 * o + j]);
  }
}

template <int R, bool kQ4_1>
void tiles(const uint8_t* weights, const Activations& a, int64_t begin, int64_t end,
           int64_t out_features, bool add, float* out) {
  const int64_t blocks = a.blocks;
  const int64_t block_bytes = kQ4_1 ? kQ4_1TileBlock : kQ8_0TileBlock;
  const int64_t quant_bytes = kQ4_1 ? kQ4_1Quants : kQ8_0Quants;
  float sums[R * kTile];
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* tile = weights + t * blocks * block_bytes;
    for (int64_t o = 0; o < kTile; ++o) {
      for (int r = 0; r < R; ++r) {
        float acc = 0.f, offsets = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* w = tile + b * block_bytes;
          const int8_t* x = a.q.data() + (r * blocks + b) * kBlock;
          int32_t dot = 0;
          for (int64_t i = 0; i < kBlock; ++i) dot += weight_at<kQ4_1>(w, o, i) * x[i];
          const uint8_t* scales = w + quant_bytes;
          acc += half_to_float(scales + 2 * o) * a.d[r * blocks + b] * static_cast<float>(dot);
          if constexpr (kQ4_1) offsets += half_to_float(scales + 2 * kTile + 2 * o) * a.s[r * blocks + b];
        }
        sums[r * kTile + o] = acc + offsets;
      }
    }
    store_tile(sums, R, t * kTile, out_features, add, out);
  }
}

#endif

const Activations& quantize_input(const at::Tensor& x, int64_t blocks) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, in] matrix");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "x must have 1 to ", kMaxRows, " rows");
  TORCH_CHECK(x.size(1) % kBlock == 0, "in_features must be a multiple of ", kBlock);
  TORCH_CHECK(blocks == x.size(1) / kBlock, "the weight's blocks do not match in_features ", x.size(1));
  if (x.scalar_type() == at::kBFloat16) {
    return quantize_activations(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1));
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
  return quantize_activations(x.data_ptr<float>(), x.size(0), x.size(1));
}

// Tiles per task (64 outputs): a thread's share is one contiguous slice of the weight.
constexpr int64_t kGrainTiles = 4;

// The instantiation for `rows` activation rows (register-held accumulators per row).
template <bool kQ4_1>
void tiles_of_rows(int64_t rows, const uint8_t* w, const Activations& a, int64_t begin, int64_t end,
                   int64_t n, bool add, float* out) {
  switch (rows) {
    case 1: tiles<1, kQ4_1>(w, a, begin, end, n, add, out); break;
    case 2: tiles<2, kQ4_1>(w, a, begin, end, n, add, out); break;
    case 3: tiles<3, kQ4_1>(w, a, begin, end, n, add, out); break;
    case 4: tiles<4, kQ4_1>(w, a, begin, end, n, add, out); break;
    case 5: tiles<5, kQ4_1>(w, a, begin, end, n, add, out); break;
    case 6: tiles<6, kQ4_1>(w, a, begin, end, n, add, out); break;
    case 7: tiles<7, kQ4_1>(w, a, begin, end, n, add, out); break;
    default: tiles<8, kQ4_1>(w, a, begin, end, n, add, out); break;
  }
}

void run_share(const Activations& a, int64_t rows, const deepwell::BlockLinear& w,
               deepwell::TileShare share, bool add, float* out) {
  if (w.q4_1) {
    tiles_of_rows<true>(rows, w.weights, a, share.begin, share.end, w.out_features, add, out);
  } else {
    tiles_of_rows<false>(rows, w.weights, a, share.begin, share.end, w.out_features, add, out);
  }
}

void run_tiles(const Activations& a, int64_t rows, const deepwell::BlockLinear& w, float* out) {
  const int64_t tiles = (w.out_features + kTile - 1) / kTile;
  at::parallel_for(0, tiles, kGrainTiles, [&](int64_t begin, int64_t end) {
    run_share(a, rows, w, {begin, end}, false, out);
  });
}

// x [rows, in] @ W.T for `weights` uint8 [tiles, blocks * tile block bytes] in the layout
// above, of `out_features` real outputs.
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& weights, int64_t out_features, bool q4_1) {
  const int64_t tile_block = q4_1 ? kQ4_1TileBlock : kQ8_0TileBlock;
  TORCH_CHECK(weights.scalar_type() == at::kByte && weights.dim() == 2 && weights.is_contiguous(),
              "weights must be a contiguous uint8 [tiles, bytes] matrix");
  TORCH_CHECK(out_features >= 1 && weights.size(0) == (out_features + kTile - 1) / kTile,
              "weights must hold one tile per ", kTile, " of the ", out_features, " outputs");
  TORCH_CHECK(weights.size(1) % tile_block == 0, "a tile must hold whole blocks");
  const int64_t blocks = weights.size(1) / tile_block;
  const Activations& a = quantize_input(x, blocks);
  auto out = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
  run_tiles(a, x.size(0), deepwell::BlockLinear{q4_1, weights.data_ptr<uint8_t>(), out_features, blocks},
            out.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& weights, int64_t out_features) {
  return block_linear(x, weights, out_features, true);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& weights, int64_t out_features) {
  return block_linear(x, weights, out_features, false);
}

}  // namespace

std::pair<const uint8_t*, int64_t> deepwell::share_bytes(const BlockLinear& w, TileShare share) {
  const int64_t tile_bytes = w.blocks * (w.q4_1 ? kQ4_1TileBlock : kQ8_0TileBlock);
  return {w.weights + share.begin * tile_bytes, (share.end - share.begin) * tile_bytes};
}

std::pair<int64_t, int64_t> deepwell::block_linear_share(
    const float* x, int64_t rows, int64_t in_features, const BlockLinear& w, TileShare share,
    bool add, float* out) {
  run_share(quantize_activations(x, rows, in_features), rows, w, share, add, out);
  return {std::min(share.begin * kTile, w.out_features), std::min(share.end * kTile, w.out_features)};
}

namespace {

// The activation quantisation the linears apply, for the tests: (q int8 [rows, B * 32],
// d float [rows, B], s float [rows, B]).
std::vector<at::Tensor> quantize_rows(const at::Tensor& x) {
  const Activations& a = quantize_input(x, x.size(1) / kBlock);
  const int64_t rows = x.size(0), blocks = a.blocks;
  auto q = at::from_blob(const_cast<int8_t*>(a.q.data()), {rows, blocks * kBlock}, at::kChar).clone();
  auto d = at::from_blob(const_cast<float*>(a.d.data()), {rows, blocks}, at::kFloat).clone();
  auto s = at::from_blob(const_cast<float*>(a.s.data()), {rows, blocks}, at::kFloat).clone();
  return {q, d, s};
}

std::string instruction_set() {
#if defined(QUANT_VNNI)
  return "avx512_vnni";
#elif defined(QUANT_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

// In the one extension of several sources (decode_kernel.py), llama_decode.cpp's module is
// the extension's.
#if !defined(DEEPWELL_ONE_EXTENSION)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_linear", &q4_1_linear, "x @ Q4_1 weight.T, float32 accumulation, x's dtype out (CPU)",
        py::arg("x"), py::arg("weights"), py::arg("out_features"));
  m.def("q8_0_linear", &q8_0_linear, "x @ Q8_0 weight.T, float32 accumulation, x's dtype out (CPU)",
        py::arg("x"), py::arg("weights"), py::arg("out_features"));
  m.def("quantize_rows", &quantize_rows, "the linears' activation quantisation, for tests");
  m.def("instruction_set", &instruction_set, "the path this build compiled: avx512_vnni, avx2, scalar");
  m.attr("max_rows") = kMaxRows;
  m.attr("tile_outputs") = kTile;
}
#endif
