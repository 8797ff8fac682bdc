// Linears that read DeepSeek-V4.1's released weight encodings as they are stored (spec §3.8):
// no weight is ever expanded to bf16 or float32 in memory. Built by decode_kernel.py, called
// through layers/blockscaled.py.
//
//   fp8_block_linear  x @ W.T, W float8_e4m3fn [out, in] with an e8m0 scale per 32×32 block;
//   bf16_linear       x @ W.T, W bfloat16 [out, in];
//   f32_linear        x @ W.T, W float32 [out, in] (the batch-invariant mode's float32 linears);
//   mxfp4_experts     one MoE layer's routed experts, W1/W3/W2 as int8 pairs of E2M1 codes
//                     [out, in / 2] with an e8m0 scale per output row and 32 inputs, each
//                     expert's six tensors reached through int64 pointer tables.
//
// Every output is one dot product over the input in blocks of 32: the block's 32 weights are
// decoded to float32 exactly in registers and multiplied into float32 accumulators
// (AVX-512: one 16-lane one per output and activation row, in tiles of 4 outputs × 4 rows;
// AVX2: two 8-lane ones, one output at a time, 4 for a lone row of a bf16 or float32 weight;
// scalar: one running sum), which are summed across lanes at the end.
// Decoding:
//   e4m3 byte b → fp16 bits (b & 0x80) << 8 | (b & 0x7F) << 7, which is the value × 2^-8
//     exactly, subnormals included, and never inf/NaN (e4m3fn's NaN byte reads as 480), then
//     vcvtph2ps; the 2^8 and the block's scale are folded into a copy of the activations
//     made per 32 output rows (a power of two: exact while x stays in float32's normal range);
//   bf16 → the 16 bits shifted to a float32's top;
//   E2M1 → a 16-entry (AVX2: 8 magnitudes and the sign bit) table already multiplied by the
//     block's scale, indexed by the nibble (vpermps); the activations are stored per block
//     with even and odd inputs apart so the low and high nibbles meet their own inputs.
// Inputs that are not a multiple of 32 end in a partial block read from a zero-padded copy
// against zero-padded activations.
//
// bfloat16 activations on a CPU with AVX-512 BF16 and VBMI take bf16 products instead
// (vdpbf16ps; see "FP8 weights against bfloat16 activations" below), for FP8 and bf16 weights.
//
// A row's result depends only on that row: rows are taken in register groups of up to
// kGroup, and every row of a group runs the same operations in the same order as it would
// alone (the batch-invariant engine relies on it; tests/engine/layers/test_blockscaled.py).
// The path depends on the activations' dtype, never on the row count.
//
// The instruction set is fixed at compile time (-march=native): AVX-512 (F + BW), else AVX2
// with FMA and F16C, else scalar C++. DEEPWELL_BLOCKSCALED_AVX2 / DEEPWELL_BLOCKSCALED_SCALAR
// force the lower paths (the tests build each).

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if !defined(DEEPWELL_BLOCKSCALED_SCALAR) && !defined(DEEPWELL_BLOCKSCALED_AVX2) && \
    defined(__AVX512F__) && defined(__AVX512BW__)
#define BLOCKSCALED_AVX512 1
#elif !defined(DEEPWELL_BLOCKSCALED_SCALAR) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BLOCKSCALED_AVX2 1
#endif

#if defined(BLOCKSCALED_AVX512) || defined(BLOCKSCALED_AVX2)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
// Activation rows that share one decoded weight vector (registers: 2 accumulators a row).
constexpr int kGroup = 4;
// Activation rows whose scaled copy is kept per 32 output rows (fp8) or per task: bounds the
// copy to kRowChunk × in floats, which stays in L2 while the weight rows pass over it.
constexpr int64_t kRowChunk = 32;
// Expert rows per parallel task: an expert's rows split across threads even at one token.
constexpr int64_t kExpertTaskRows = 32;
// E2M1 codes 0..15: bit 3 the sign, bits 0-2 the magnitude.
alignas(64) constexpr float kE2M1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                         -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

enum class Format { kFp8, kBf16, kMxFp4, kF32 };

// Bytes of one block of 32 weights of one row.
template <Format F>
constexpr int64_t block_bytes() {
  return F == Format::kFp8 ? 32 : F == Format::kBf16 ? 64 : F == Format::kF32 ? 128 : 16;
}

// Bytes of `columns` weights of one row (even for MXFP4, checked by the callers).
template <Format F>
constexpr int64_t bytes_of(int64_t columns) {
  return F == Format::kFp8 ? columns : F == Format::kBf16 ? 2 * columns : F == Format::kF32 ? 4 * columns : columns / 2;
}

int64_t padded(int64_t columns) { return (columns + kBlock - 1) / kBlock * kBlock; }

constexpr int64_t kLine = 64;
// A decode step reads each weight once, so its weights stream from memory, and a tile's rows
// (kOutputs of them, 0.5–2 KiB each) are too short for the hardware prefetcher to run ahead:
// while a tile computes, the tile `ahead` bytes on (the next kOutputs rows, contiguous) is
// fetched line by line. A prefetch never faults, so past a matrix's end it is only wasted.
inline void prefetch_line(const uint8_t* p) { __builtin_prefetch(p, 0, 3); }

// E8M0 byte b → 2^(b - 127); 0 is float32's subnormal 2^-127, 255 NaN.
inline float e8m0_to_float(uint8_t b) {
  if (b == 255) return std::numeric_limits<float>::quiet_NaN();
  const uint32_t bits = b == 0 ? 0x00400000u : static_cast<uint32_t>(b) << 23;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// Where input k (0..31) of a block sits in the MXFP4 activation copy: the order in which the
// path decodes a block's 16 bytes (even inputs are low nibbles, odd ones high).
inline int64_t mxfp4_lane(int64_t k) {
#if defined(BLOCKSCALED_AVX512)
  return (k % 2) * 16 + k / 2;  // 16 even inputs, then 16 odd
#elif defined(BLOCKSCALED_AVX2)
  const int64_t byte = k / 2;  // per 8 bytes: their 8 even inputs, then their 8 odd
  return (byte / 8) * 16 + (k % 2) * 8 + byte % 8;
#else
  return k;
#endif
}

#if defined(BLOCKSCALED_AVX512)

// Output rows decoded per block and multiplied into every row of a group: an activation
// vector loaded once serves 4 outputs, and 4 × rows accumulator chains hide the fma latency.
constexpr int kOutputs = 4;
// One 16-lane accumulator per (output, row): fma'd with the block's first 16 weights, then
// its last 16.
constexpr int kChains = 1;
using Vector = __m512;

// The block's 32 weights as two vectors of 16 (MXFP4: the 16 even inputs, then the 16 odd).
template <Format F>
inline void decode_block(const uint8_t* w, float scale, __m512& first, __m512& second) {
  if constexpr (F == Format::kFp8) {
    // Sign-extended to 16 bits, shifted by 7: bits 7-13 the magnitude, 14 and 15 the sign;
    // clearing bit 14 leaves the fp16 of value × 2^-8.
    __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    h = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16(static_cast<int16_t>(0xBFFF)));
    first = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    second = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  } else if constexpr (F == Format::kF32) {
    first = _mm512_loadu_ps(w);
    second = _mm512_loadu_ps(w + 64);
  } else if constexpr (F == Format::kBf16) {
    const auto* p = reinterpret_cast<const __m256i*>(w);
    first = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16));
    second = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p + 1)), 16));
  } else {
    const __m512 table = _mm512_mul_ps(_mm512_load_ps(kE2M1), _mm512_set1_ps(scale));
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    // vpermps reads the index's low 4 bits: the low nibble as it is, the high one shifted.
    first = _mm512_permutexvar_ps(codes, table);
    second = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
  }
}

// O outputs' blocks (w[o], scale[o]) times R rows' 32 activations (x[r] + at).
template <Format F, int O, int R>
inline void accumulate_block(const uint8_t* const* w, const float* scale, const float* const* x, int64_t at,
                             __m512 (&acc)[O][R][kChains]) {
  __m512 first[O], second[O];
  for (int o = 0; o < O; ++o) decode_block<F>(w[o], scale[o], first[o], second[o]);
  for (int r = 0; r < R; ++r) {
    const __m512 x0 = _mm512_loadu_ps(x[r] + at), x1 = _mm512_loadu_ps(x[r] + at + 16);
    for (int o = 0; o < O; ++o) {
      acc[o][r][0] = _mm512_fmadd_ps(first[o], x0, acc[o][r][0]);
      acc[o][r][0] = _mm512_fmadd_ps(second[o], x1, acc[o][r][0]);
    }
  }
}

inline float reduce(const __m512 (&acc)[kChains]) { return _mm512_reduce_add_ps(acc[0]); }
inline __m512 zero() { return _mm512_setzero_ps(); }

#elif defined(BLOCKSCALED_AVX2)

// One output at a time (16 registers leave no room for more rows of a group; a lone row
// takes kLoneRowOutputs), two 8-lane accumulators a row:
// the block's vectors 0 and 2 into the first, 1 and 3 into the second.
constexpr int kOutputs = 1;
constexpr int kChains = 2;
using Vector = __m256;

// 16 e4m3 bytes → their values × 2^-8 as two vectors of 8 (see the AVX-512 path).
inline void e4m3_scaled(const uint8_t* w, __m256& low, __m256& high) {
  __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  low = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  high = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

inline __m256 bf16_of(const uint8_t* w) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// 8 code bytes → (their low nibbles' weights, their high nibbles' weights): the magnitude
// from an 8-entry table (vpermps reads 3 bits), the sign (bit 3 of the nibble) moved to bit 31.
inline void e2m1_of(const uint8_t* w, __m256 table, __m256& even, __m256& odd) {
  const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
  const __m256i sign = _mm256_set1_epi32(static_cast<int32_t>(0x80000000u));
  const __m256i high = _mm256_srli_epi32(codes, 4);
  even = _mm256_xor_ps(_mm256_permutevar8x32_ps(table, codes),
                       _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(codes, 28), sign)));
  odd = _mm256_xor_ps(_mm256_permutevar8x32_ps(table, high),
                      _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(codes, 24), sign)));
}

template <Format F, int O, int R>
inline void accumulate_block(const uint8_t* const* w, const float* scale, const float* const* x, int64_t at,
                             __m256 (&acc)[O][R][kChains]) {
  for (int o = 0; o < O; ++o) {
    __m256 v[4];
    if constexpr (F == Format::kFp8) {
      e4m3_scaled(w[o], v[0], v[1]);
      e4m3_scaled(w[o] + 16, v[2], v[3]);
    } else if constexpr (F == Format::kBf16) {
      for (int i = 0; i < 4; ++i) v[i] = bf16_of(w[o] + 16 * i);
    } else if constexpr (F == Format::kF32) {
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(w[o] + 32 * i));
    } else {
      const __m256 table = _mm256_mul_ps(_mm256_load_ps(kE2M1), _mm256_set1_ps(scale[o]));
      e2m1_of(w[o], table, v[0], v[1]);
      e2m1_of(w[o] + 8, table, v[2], v[3]);
    }
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 4; ++i) {
        acc[o][r][i % 2] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(x[r] + at + 8 * i), acc[o][r][i % 2]);
      }
    }
  }
}

inline float reduce(const __m256 (&acc)[kChains]) {
  const __m256 sum = _mm256_add_ps(acc[0], acc[1]);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m256 zero() { return _mm256_setzero_ps(); }

#else

// One running sum per (output, row), fma'd in input order.
constexpr int kOutputs = 1;
constexpr int kChains = 1;
using Vector = float;

inline float e4m3_scaled(uint8_t b) {
  const uint16_t bits = static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

template <Format F>
inline float weight_at(const uint8_t* w, float scale, int64_t k) {
  if constexpr (F == Format::kFp8) {
    return e4m3_scaled(w[k]);
  } else if constexpr (F == Format::kF32) {
    float value;
    std::memcpy(&value, w + 4 * k, sizeof value);
    return value;
  } else if constexpr (F == Format::kBf16) {
    const uint32_t bits = static_cast<uint32_t>(w[2 * k] | (w[2 * k + 1] << 8)) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
  } else {
    return kE2M1[(w[k / 2] >> (4 * (k % 2))) & 0x0F] * scale;
  }
}

template <Format F, int O, int R>
inline void accumulate_block(const uint8_t* const* w, const float* scale, const float* const* x, int64_t at,
                             float (&acc)[O][R][kChains]) {
  for (int o = 0; o < O; ++o) {
    for (int64_t k = 0; k < kBlock; ++k) {
      const float value = weight_at<F>(w[o], scale[o], k);
      for (int r = 0; r < R; ++r) acc[o][r][0] = std::fma(value, x[r][at + k], acc[o][r][0]);
    }
  }
}

inline float reduce(const float (&acc)[kChains]) { return acc[0]; }
inline float zero() { return 0.f; }

#endif

// result[o * R + r] = Σ_k w[o]_k x[r][k] for O weight rows of `columns` inputs and R
// activation rows, zero-padded to a whole block (MXFP4: in mxfp4_lane order); `scales[o]`
// the row's e8m0 per block (MXFP4; unused otherwise). Each (o, r) runs the same operations
// whatever O and R are. `ahead`: see prefetch_line.
template <Format F, int O, int R>
void dot_tile(const uint8_t* const* w, const uint8_t* const* scales, int64_t columns, const float* const* x,
              int64_t ahead, float* result) {
  Vector acc[O][R][kChains];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains; ++c) acc[o][r][c] = zero();
  const int64_t full = columns / kBlock;
  const uint8_t* at[O];
  float scale[O];
  auto scales_of = [&](int64_t b) {
    for (int o = 0; o < O; ++o) scale[o] = F == Format::kMxFp4 ? e8m0_to_float(scales[o][b]) : 1.f;
  };
  for (int64_t b = 0; b < full; ++b) {
    for (int o = 0; o < O; ++o) at[o] = w[o] + b * block_bytes<F>();
    // Every line of the block (float32's is two), once per line where blocks are shorter.
    if (b * block_bytes<F>() % kLine == 0)
      for (int64_t line = 0; line < block_bytes<F>(); line += kLine)
        for (int o = 0; o < O; ++o) prefetch_line(at[o] + line + ahead);
    scales_of(b);
    accumulate_block<F, O, R>(at, scale, x, b * kBlock, acc);
  }
  if (columns % kBlock) {
    alignas(64) uint8_t last[O][block_bytes<F>()] = {};
    for (int o = 0; o < O; ++o) {
      std::memcpy(last[o], w[o] + full * block_bytes<F>(), bytes_of<F>(columns % kBlock));
      at[o] = last[o];
    }
    scales_of(full);
    accumulate_block<F, O, R>(at, scale, x, full * kBlock, acc);
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) result[o * R + r] = reduce(acc[o][r]);
}

template <Format F, int O>
void dot_tile_rows(int rows, const uint8_t* const* w, const uint8_t* const* scales, int64_t columns,
                   const float* const* x, int64_t ahead, float* result) {
  switch (rows) {
    case 1: dot_tile<F, O, 1>(w, scales, columns, x, ahead, result); break;
    case 2: dot_tile<F, O, 2>(w, scales, columns, x, ahead, result); break;
    case 3: dot_tile<F, O, 3>(w, scales, columns, x, ahead, result); break;
    default: dot_tile<F, O, 4>(w, scales, columns, x, ahead, result); break;
  }
}

// dot_tile for `outputs` (1..kOutputs) weight rows and `rows` (1..kGroup) activation rows.
template <Format F>
void dot_group(int outputs, int rows, const uint8_t* const* w, const uint8_t* const* scales, int64_t columns,
               const float* const* x, int64_t ahead, float* result) {
  switch (outputs) {
    case 1: dot_tile_rows<F, 1>(rows, w, scales, columns, x, ahead, result); break;
    case 2: if constexpr (kOutputs >= 2) dot_tile_rows<F, 2>(rows, w, scales, columns, x, ahead, result); break;
    case 3: if constexpr (kOutputs >= 3) dot_tile_rows<F, 3>(rows, w, scales, columns, x, ahead, result); break;
    default: if constexpr (kOutputs >= 4) dot_tile_rows<F, 4>(rows, w, scales, columns, x, ahead, result); break;
  }
}

// One tile's weight rows [first, first + count) of a matrix (with the rows' scales, MXFP4).
struct RowTile {
  const uint8_t* rows[kOutputs];
  const uint8_t* scales[kOutputs];
  int count;
};

#if defined(BLOCKSCALED_AVX2)
// A lone activation row leaves the registers for more outputs a pass than kOutputs: their
// weight rows stream side by side, and each output still runs its own two accumulators in
// the same order as alone (dot_tile), so the same bits.
constexpr int kLoneRowOutputs = 4;

// output_rows for one activation row of a bf16 or float32 weight.
template <Format F>
void lone_row_outputs(const uint8_t* weight, int64_t columns, int64_t o_begin, int64_t o_end, const float* x,
                      float* out) {
  const int64_t row_bytes = bytes_of<F>(columns);
  const float* row[1] = {x};
  const uint8_t* no_scales[kLoneRowOutputs] = {};
  int64_t o = o_begin;
  for (; o + kLoneRowOutputs <= o_end; o += kLoneRowOutputs) {
    const uint8_t* rows[kLoneRowOutputs];
    for (int j = 0; j < kLoneRowOutputs; ++j) rows[j] = weight + (o + j) * row_bytes;
    dot_tile<F, kLoneRowOutputs, 1>(rows, no_scales, columns, row, kLoneRowOutputs * row_bytes, out + o);
  }
  for (; o < o_end; ++o) {
    const uint8_t* rows[1] = {weight + o * row_bytes};
    dot_tile<F, 1, 1>(rows, no_scales, columns, row, row_bytes, out + o);
  }
}
#endif

// out[first + r][o] for o in [o_begin, o_end) and the `rows` rows of `x` (each `stride`
// floats, zero-padded): each row is its own dot product.
template <Format F>
void output_rows(const uint8_t* weight, int64_t columns, int64_t o_begin, int64_t o_end, const float* x,
                 int64_t stride, int64_t rows, int64_t first, int64_t out_features, float* out) {
#if defined(BLOCKSCALED_AVX2)
  if constexpr (F == Format::kF32 || F == Format::kBf16) {
    if (rows == 1) return lone_row_outputs<F>(weight, columns, o_begin, o_end, x, out + first * out_features);
  }
#endif
  const int64_t row_bytes = bytes_of<F>(columns);
  for (int64_t o = o_begin; o < o_end; o += kOutputs) {
    RowTile tile{};
    tile.count = static_cast<int>(std::min<int64_t>(kOutputs, o_end - o));
    for (int j = 0; j < tile.count; ++j) tile.rows[j] = weight + (o + j) * row_bytes;
    for (int64_t g = 0; g < rows; g += kGroup) {
      const int n = static_cast<int>(std::min<int64_t>(kGroup, rows - g));
      const float* group[kGroup];
      float result[kOutputs * kGroup];
      for (int r = 0; r < n; ++r) group[r] = x + (g + r) * stride;
      dot_group<F>(tile.count, n, tile.rows, tile.scales, columns, group, kOutputs * row_bytes, result);
      for (int j = 0; j < tile.count; ++j)
        for (int r = 0; r < n; ++r) out[(first + g + r) * out_features + o + j] = result[j * n + r];
    }
  }
}

#if defined(BLOCKSCALED_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define BLOCKSCALED_DOT_BF16 1

// FP8 weights against bfloat16 activations (AVX-512 BF16 + VBMI): every e4m3 value is a
// bfloat16 exactly (4 significant bits), so the weights are decoded to bf16 pairs by two
// 128-entry byte lookups (vpermi2b: the low and high bytes of the magnitude's bf16, sign ORed
// in) and multiplied by vdpbf16ps, 32 products an instruction against fma's 16, each product
// exact, and so are the activations times a block's power-of-two scale (bf16 has float32's
// exponent range), made per 32 output rows from one copy of the bf16 rows. Columns go in steps
// of 64: the byte interleave (vpunpck[lh]bw, per 128-bit lane) puts columns 0-7, 16-23, 32-39,
// 48-55 in the first vector and the rest in the second, and the activation copy is laid out to
// match (pair_lane): its 16-word runs each hold one 32-column block's columns.
constexpr int64_t kPairStep = 64;

struct E4m3Bf16Tables {
  alignas(64) uint8_t low[128];
  alignas(64) uint8_t high[128];
};

// The bf16 bits of the e4m3 magnitudes 0..127 (127, e4m3fn's NaN, reads as 480).
const E4m3Bf16Tables& e4m3_bf16_tables() {
  static const E4m3Bf16Tables tables = [] {
    E4m3Bf16Tables t{};
    for (int m = 0; m < 128; ++m) {
      const float value = m < 8 ? std::ldexp(static_cast<float>(m), -9)
                                : std::ldexp(static_cast<float>(8 + (m & 7)), (m >> 3) - 10);
      uint32_t bits;
      std::memcpy(&bits, &value, sizeof bits);
      t.low[m] = static_cast<uint8_t>(bits >> 16);
      t.high[m] = static_cast<uint8_t>(bits >> 24);
    }
    return t;
  }();
  return tables;
}

// Where column k (0..63) of a step sits in the activation copy.
inline int64_t pair_lane(int64_t k) { return (k % 16) / 8 * 32 + k / 16 * 8 + k % 8; }

// result[o * R + r] = Σ_k w[o]_k x[r][k] for O e4m3 rows and R bf16 activation rows (pair_lane
// order, zero-padded to whole steps), one accumulator per (o, r) whatever O and R are.
// kBf16: the weights are bf16 already (bf16_linear): a step's two vectors are its 64 columns
// in order, and the activations are in plain column order.
template <int O, int R, bool kBf16>
void pair_tile(const uint8_t* const* w, int64_t columns, const uint16_t* const* x, int64_t ahead, float* result) {
  constexpr int64_t kStepBytes = kBf16 ? 2 * kPairStep : kPairStep;
  const E4m3Bf16Tables& t = e4m3_bf16_tables();
  const __m512i low0 = _mm512_load_si512(t.low), low1 = _mm512_load_si512(t.low + 64);
  const __m512i high0 = _mm512_load_si512(t.high), high1 = _mm512_load_si512(t.high + 64);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[O][R];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = _mm512_setzero_ps();
  auto step = [&](const uint8_t* const* at, int64_t c) {
    __m512i first[O], second[O];
    for (int o = 0; o < O; ++o) {
      if constexpr (kBf16) {
        first[o] = _mm512_loadu_si512(at[o]);
        second[o] = _mm512_loadu_si512(at[o] + 64);
        continue;
      }
      const __m512i bytes = _mm512_loadu_si512(at[o]);
      const __m512i low = _mm512_permutex2var_epi8(low0, bytes, low1);
      // high | (bytes & 0x80): the sign into the high byte's top bit.
      const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(high0, bytes, high1), bytes, sign, 0xF8);
      first[o] = _mm512_unpacklo_epi8(low, high);
      second[o] = _mm512_unpackhi_epi8(low, high);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i x0 = _mm512_loadu_si512(x[r] + c), x1 = _mm512_loadu_si512(x[r] + c + 32);
      for (int o = 0; o < O; ++o) {
        acc[o][r] = _mm512_dpbf16_ps(acc[o][r], (__m512bh)first[o], (__m512bh)x0);
        acc[o][r] = _mm512_dpbf16_ps(acc[o][r], (__m512bh)second[o], (__m512bh)x1);
      }
    }
  };
  const int64_t full = columns / kPairStep;
  const uint8_t* at[O];
  for (int64_t b = 0; b < full; ++b) {
    for (int o = 0; o < O; ++o) {
      at[o] = w[o] + b * kStepBytes;
      for (int64_t line = 0; line < kStepBytes; line += kLine) prefetch_line(at[o] + line + ahead);
    }
    step(at, b * kPairStep);
  }
  if (columns % kPairStep) {
    alignas(64) uint8_t last[O][kStepBytes] = {};
    for (int o = 0; o < O; ++o) {
      std::memcpy(last[o], w[o] + full * kStepBytes, kStepBytes / kPairStep * (columns % kPairStep));
      at[o] = last[o];
    }
    step(at, full * kPairStep);
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) result[o * R + r] = _mm512_reduce_add_ps(acc[o][r]);
}

template <int O, bool kBf16>
void pair_tile_rows(int rows, const uint8_t* const* w, int64_t columns, const uint16_t* const* x, int64_t ahead,
                    float* result) {
  switch (rows) {
    case 1: pair_tile<O, 1, kBf16>(w, columns, x, ahead, result); break;
    case 2: pair_tile<O, 2, kBf16>(w, columns, x, ahead, result); break;
    case 3: pair_tile<O, 3, kBf16>(w, columns, x, ahead, result); break;
    default: pair_tile<O, 4, kBf16>(w, columns, x, ahead, result); break;
  }
}

// output_rows for bf16 activations against e4m3 weights (activations in pair_lane order) or
// bf16 weights (kBf16; plain order).
template <bool kBf16>
void pair_output_rows(const uint8_t* weight, int64_t columns, int64_t o_begin, int64_t o_end, const uint16_t* x,
                      int64_t stride, int64_t rows, int64_t first, int64_t out_features, float* out) {
  for (int64_t o = o_begin; o < o_end; o += kOutputs) {
    const int count = static_cast<int>(std::min<int64_t>(kOutputs, o_end - o));
    const uint8_t* tile[kOutputs];
    const int64_t row_bytes = columns * (kBf16 ? 2 : 1);
    const int64_t ahead = kOutputs * row_bytes;
    for (int j = 0; j < count; ++j) tile[j] = weight + (o + j) * row_bytes;
    for (int64_t g = 0; g < rows; g += kGroup) {
      const int n = static_cast<int>(std::min<int64_t>(kGroup, rows - g));
      const uint16_t* group[kGroup];
      float result[kOutputs * kGroup];
      for (int r = 0; r < n; ++r) group[r] = x + (g + r) * stride;
      switch (count) {
        case 1: pair_tile_rows<1, kBf16>(n, tile, columns, group, ahead, result); break;
        case 2: pair_tile_rows<2, kBf16>(n, tile, columns, group, ahead, result); break;
        case 3: pair_tile_rows<3, kBf16>(n, tile, columns, group, ahead, result); break;
        default: pair_tile_rows<4, kBf16>(n, tile, columns, group, ahead, result); break;
      }
      for (int j = 0; j < count; ++j)
        for (int r = 0; r < n; ++r) out[(first + g + r) * out_features + o + j] = result[j * n + r];
    }
  }
}
#endif

at::Tensor float_rows(const at::Tensor& x, int64_t columns, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == columns, what, ": x must be [rows, ", columns, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu(), what, ": x must be on the CPU");
  return x.to(at::kFloat).contiguous();
}

void check_weight(const at::Tensor& w, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(w.scalar_type() == dtype, what, ": the weight must be ", dtype, ", got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), what,
              ": the weight must be a contiguous [out, in] CPU matrix");
}

at::Tensor fp8_block_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scale) {
  check_weight(weight, at::kFloat8_e4m3fn, "fp8_block_linear");
  const int64_t out_features = weight.size(0), columns = weight.size(1);
  const int64_t row_blocks = (out_features + kBlock - 1) / kBlock, column_blocks = (columns + kBlock - 1) / kBlock;
  TORCH_CHECK(scale.scalar_type() == at::kFloat8_e8m0fnu && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == row_blocks && scale.size(1) == column_blocks,
              "fp8_block_linear: the scale must be a contiguous float8_e8m0fnu [", row_blocks, ", ",
              column_blocks, "], got ", scale.scalar_type(), " ", scale.sizes());
  const at::Tensor x = float_rows(x_in, columns, "fp8_block_linear");
  const int64_t rows = x.size(0);
  auto out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;
  const auto* w = static_cast<const uint8_t*>(weight.data_ptr());
  const auto* scales = static_cast<const uint8_t*>(scale.data_ptr());
  const float* xs = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t stride = padded(columns);
#if defined(BLOCKSCALED_DOT_BF16)
  if (x_in.scalar_type() == at::kBFloat16) {
    // The rows' bf16 bits in pair_lane order, zero-padded to whole steps: one copy for all.
    const int64_t pair_stride = (columns + kPairStep - 1) / kPairStep * kPairStep;
    std::vector<uint16_t> pairs(rows * pair_stride, 0);
    const at::Tensor bits = x_in.contiguous();
    const auto* src = static_cast<const uint16_t*>(bits.data_ptr());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < columns; ++c) {
        pairs[r * pair_stride + c / kPairStep * kPairStep + pair_lane(c % kPairStep)] = src[r * columns + c];
      }
    }
    at::parallel_for(0, row_blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint16_t> scaled(std::min(rows, kRowChunk) * pair_stride);
      for (int64_t ob = begin; ob < end; ++ob) {
        for (int64_t first = 0; first < rows; first += kRowChunk) {
          const int64_t n = std::min(kRowChunk, rows - first);
          // Each 16-word run times its block's scale: widened to float32, multiplied, the top
          // 16 bits kept (exact: at most 8 significant bits).
          for (int64_t run = 0; run < n * pair_stride / 16; ++run) {
            const int64_t within = run % (pair_stride / 16) % 4;
            const int64_t cb = run % (pair_stride / 16) / 4 * 2 + within % 2;
            const float s = cb < column_blocks ? e8m0_to_float(scales[ob * column_blocks + cb]) : 0.f;
            const __m512i bits = _mm512_cvtepu16_epi32(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs.data() + first * pair_stride + 16 * run)));
            const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)), _mm512_set1_ps(s));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(scaled.data() + 16 * run),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(value), 16)));
          }
          pair_output_rows<false>(w, columns, ob * kBlock, std::min(out_features, (ob + 1) * kBlock), scaled.data(),
                           pair_stride, n, first, out_features, o);
        }
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, row_blocks, 1, [&](int64_t begin, int64_t end) {
    // x times each column block's scale × 2^8 (the decoded weights are value × 2^-8).
    std::vector<float> scaled(std::min(rows, kRowChunk) * stride, 0.f);
    for (int64_t ob = begin; ob < end; ++ob) {
      for (int64_t first = 0; first < rows; first += kRowChunk) {
        const int64_t n = std::min(kRowChunk, rows - first);
        for (int64_t r = 0; r < n; ++r) {
          const float* src = xs + (first + r) * columns;
          float* dst = scaled.data() + r * stride;
          for (int64_t cb = 0; cb < column_blocks; ++cb) {
            const float s = e8m0_to_float(scales[ob * column_blocks + cb]) * 256.f;
            const int64_t stop = std::min(columns, (cb + 1) * kBlock);
            for (int64_t c = cb * kBlock; c < stop; ++c) dst[c] = src[c] * s;
          }
        }
        output_rows<Format::kFp8>(w, columns, ob * kBlock, std::min(out_features, (ob + 1) * kBlock),
                                  scaled.data(), stride, n, first, out_features, o);
      }
    }
  });
  return out;
}

// out = x @ weight.T for float32 rows `x` and a bf16 or float32 `weight` [out, in], each
// output one dot product in blocks of 32 (dot_tile), outputs split across threads in blocks.
template <Format F>
void plain_linear(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
  const int64_t out_features = weight.size(0), columns = weight.size(1), rows = x.size(0);
  const int64_t stride = padded(columns);
  // Zero-padded to whole blocks (a copy only where the width is not one already).
  const at::Tensor xp = stride == columns ? x : at::constant_pad_nd(x, {0, stride - columns}, 0);
  const auto* w = static_cast<const uint8_t*>(weight.data_ptr());
  const float* xs = xp.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t row_blocks = (out_features + kBlock - 1) / kBlock;
  at::parallel_for(0, row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ob = begin; ob < end; ++ob) {
      for (int64_t first = 0; first < rows; first += kRowChunk) {
        output_rows<F>(w, columns, ob * kBlock, std::min(out_features, (ob + 1) * kBlock), xs + first * stride,
                       stride, std::min(kRowChunk, rows - first), first, out_features, o);
      }
    }
  });
}

at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& weight) {
  check_weight(weight, at::kBFloat16, "bf16_linear");
  const int64_t out_features = weight.size(0), columns = weight.size(1);
  const at::Tensor x = float_rows(x_in, columns, "bf16_linear");
  const int64_t rows = x.size(0);
  auto out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;
#if defined(BLOCKSCALED_DOT_BF16)
  if (x_in.scalar_type() == at::kBFloat16) {
    // bf16 rows against bf16 weights: vdpbf16ps on the stored pairs, rows zero-padded to whole
    // steps of 64.
    const int64_t pair_stride = (columns + kPairStep - 1) / kPairStep * kPairStep;
    const at::Tensor xp = at::constant_pad_nd(x_in.contiguous(), {0, pair_stride - columns}, 0);
    const auto* xs = static_cast<const uint16_t*>(xp.data_ptr());
    const auto* w = static_cast<const uint8_t*>(weight.data_ptr());
    float* o = out.data_ptr<float>();
    const int64_t row_blocks = (out_features + kBlock - 1) / kBlock;
    at::parallel_for(0, row_blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t ob = begin; ob < end; ++ob) {
        for (int64_t first = 0; first < rows; first += kRowChunk) {
          pair_output_rows<true>(w, columns, ob * kBlock, std::min(out_features, (ob + 1) * kBlock),
                                 xs + first * pair_stride, pair_stride, std::min(kRowChunk, rows - first), first,
                                 out_features, o);
        }
      }
    });
    return out;
  }
#endif
  plain_linear<Format::kBf16>(x, weight, out);
  return out;
}

at::Tensor f32_linear(const at::Tensor& x_in, const at::Tensor& weight) {
  check_weight(weight, at::kFloat, "f32_linear");
  const at::Tensor x = float_rows(x_in, weight.size(1), "f32_linear");
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (x.size(0) > 0 && weight.size(0) > 0) plain_linear<Format::kF32>(x, weight, out);
  return out;
}

// One MXFP4 weight matrix of every expert: data [rows, columns / 2] and scale
// [rows, ceil(columns / 32)] addresses per expert.
struct ExpertMatrices {
  const int64_t* data;
  const int64_t* scale;
  int64_t columns;

  const uint8_t* row(int64_t expert, int64_t r) const {
    return reinterpret_cast<const uint8_t*>(data[expert]) + r * (columns / 2);
  }
  const uint8_t* scales(int64_t expert, int64_t r) const {
    return reinterpret_cast<const uint8_t*>(scale[expert]) + r * ((columns + kBlock - 1) / kBlock);
  }
};

const int64_t* table_of(const at::Tensor& t, int64_t experts, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == experts && t.is_contiguous(),
              "mxfp4_experts: ", name, " must be an int64 table of ", experts, " addresses");
  return t.data_ptr<int64_t>();
}

// The pairs' experts run over `tasks` tasks of kExpertTaskRows weight rows each: task t is
// rows [.., ..) of the (t / per_expert)-th active expert.
template <typename Body>
void expert_tasks(const std::vector<int64_t>& active, int64_t rows, Body body) {
  const int64_t per_expert = (rows + kExpertTaskRows - 1) / kExpertTaskRows;
  const int64_t tasks = static_cast<int64_t>(active.size()) * per_expert;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t % per_expert * kExpertTaskRows;
      body(active[t / per_expert], first, std::min(rows, first + kExpertTaskRows));
    }
  });
}

// The pairs of `expert` (ordered[starts[e] .. starts[e + 1])) in groups of kGroup, with each
// group's activation rows (`stride` floats apart in `x`).
template <typename Body>
void pair_groups(const std::vector<int64_t>& ordered, const std::vector<int64_t>& starts, int64_t expert,
                 const float* x, int64_t stride, Body body) {
  for (int64_t g = starts[expert]; g < starts[expert + 1]; g += kGroup) {
    const int n = static_cast<int>(std::min<int64_t>(kGroup, starts[expert + 1] - g));
    const float* rows[kGroup];
    for (int j = 0; j < n; ++j) rows[j] = x + ordered[g + j] * stride;
    body(n, rows, ordered.data() + g);
  }
}

// Row p of the result: weights[p] · expert_{slots[p]}(x[p]), with expert(x) = W2(silu(min(W1 x,
// limit)) · clamp(W3 x, ±limit)). Two passes over the active experts, each split into row tasks
// across threads: W1 and W3 into the pairs' activations, then W2.
at::Tensor mxfp4_experts(const at::Tensor& x_in, const at::Tensor& slots, const at::Tensor& weights,
                            const at::Tensor& w1, const at::Tensor& w1_scale, const at::Tensor& w3,
                            const at::Tensor& w3_scale, const at::Tensor& w2, const at::Tensor& w2_scale,
                            int64_t hidden, int64_t inter, double limit) {
  TORCH_CHECK(hidden % 2 == 0 && inter % 2 == 0 && hidden > 0 && inter > 0,
              "mxfp4_experts: hidden and intermediate sizes must be even and positive");
  const at::Tensor x = float_rows(x_in, hidden, "mxfp4_experts");
  const int64_t pairs = x.size(0), experts = w1.size(0);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == pairs,
              "mxfp4_experts: slots must be int64 [", pairs, "]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.dim() == 1 && weights.size(0) == pairs,
              "mxfp4_experts: weights must be float32 [", pairs, "]");
  const ExpertMatrices gate{table_of(w1, experts, "w1"), table_of(w1_scale, experts, "w1_scale"), hidden};
  const ExpertMatrices up{table_of(w3, experts, "w3"), table_of(w3_scale, experts, "w3_scale"), hidden};
  const ExpertMatrices down{table_of(w2, experts, "w2"), table_of(w2_scale, experts, "w2_scale"), inter};
  auto out = at::empty({pairs, hidden}, x.options());
  if (pairs == 0) return out;
  const at::Tensor slot_values = slots.contiguous();
  const at::Tensor weight_values = weights.contiguous();
  const int64_t* slot = slot_values.data_ptr<int64_t>();
  const float* routing = weight_values.data_ptr<float>();

  // Pairs by expert (a counting sort, stable), and the experts that have any.
  std::vector<int64_t> starts(experts + 1, 0), ordered(pairs), active;
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(slot[p] >= 0 && slot[p] < experts, "mxfp4_experts: slot ", slot[p], " of pair ", p,
                " is not one of the ", experts, " experts");
    ++starts[slot[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) {
    if (starts[e + 1]) active.push_back(e);
    starts[e + 1] += starts[e];
  }
  {
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) ordered[next[slot[p]]++] = p;
  }

  // The pairs' rows and their activations, zero-padded to whole blocks, in mxfp4_lane order.
  const int64_t x_stride = padded(hidden), act_stride = padded(inter);
  std::vector<float> xs(pairs * x_stride, 0.f), act(pairs * act_stride, 0.f);
  const float* src = x.data_ptr<float>();
  auto lane_of = [](int64_t c) { return c / kBlock * kBlock + mxfp4_lane(c % kBlock); };
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t c = 0; c < hidden; ++c) xs[p * x_stride + lane_of(c)] = src[p * hidden + c];
  }
  const float cap = static_cast<float>(limit);
  // An expert's rows are contiguous: a tile prefetches the next tile's rows.
  const int64_t gate_ahead = kOutputs * (hidden / 2), down_ahead = kOutputs * (inter / 2);
  // Weight rows [i, i + kOutputs) of `m` (clipped at `end`) for expert e.
  auto tile_of = [](const ExpertMatrices& m, int64_t e, int64_t i, int64_t end) {
    RowTile tile{};
    tile.count = static_cast<int>(std::min<int64_t>(kOutputs, end - i));
    for (int j = 0; j < tile.count; ++j) {
      tile.rows[j] = m.row(e, i + j);
      tile.scales[j] = m.scales(e, i + j);
    }
    return tile;
  };
  expert_tasks(active, inter, [&](int64_t e, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += kOutputs) {
      const RowTile w1_rows = tile_of(gate, e, i, end), w3_rows = tile_of(up, e, i, end);
      pair_groups(ordered, starts, e, xs.data(), x_stride, [&](int n, const float* const* rows, const int64_t* ids) {
        float h[kOutputs * kGroup], u[kOutputs * kGroup];
        dot_group<Format::kMxFp4>(w1_rows.count, n, w1_rows.rows, w1_rows.scales, hidden, rows, gate_ahead, h);
        dot_group<Format::kMxFp4>(w3_rows.count, n, w3_rows.rows, w3_rows.scales, hidden, rows, gate_ahead, u);
        for (int j = 0; j < w1_rows.count; ++j) {
          for (int r = 0; r < n; ++r) {
            const float g = std::min(h[j * n + r], cap);
            const float silu = g / (1.f + std::exp(-g));
            act[ids[r] * act_stride + lane_of(i + j)] = silu * std::clamp(u[j * n + r], -cap, cap);
          }
        }
      });
    }
  });
  float* o = out.data_ptr<float>();
  expert_tasks(active, hidden, [&](int64_t e, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += kOutputs) {
      const RowTile w2_rows = tile_of(down, e, i, end);
      pair_groups(ordered, starts, e, act.data(), act_stride, [&](int n, const float* const* rows, const int64_t* ids) {
        float y[kOutputs * kGroup];
        dot_group<Format::kMxFp4>(w2_rows.count, n, w2_rows.rows, w2_rows.scales, inter, rows, down_ahead, y);
        for (int j = 0; j < w2_rows.count; ++j)
          for (int r = 0; r < n; ++r) o[ids[r] * hidden + i + j] = routing[ids[r]] * y[j * n + r];
      });
    }
  });
  return out;
}

std::string instruction_set() {
#if defined(BLOCKSCALED_DOT_BF16)
  return "avx512_bf16";
#elif defined(BLOCKSCALED_AVX512)
  return "avx512";
#elif defined(BLOCKSCALED_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_block_linear", &fp8_block_linear, "float32 x @ (fp8 weight with 32x32 e8m0 block scales).T (CPU)",
        py::arg("x"), py::arg("weight"), py::arg("scale"));
  m.def("bf16_linear", &bf16_linear, "float32 x @ bf16 weight.T, float32 accumulation (CPU)", py::arg("x"),
        py::arg("weight"));
  m.def("f32_linear", &f32_linear, "float32 x @ float32 weight.T, each output one dot product in a fixed order (CPU)", py::arg("x"), py::arg("weight"));
  m.def("mxfp4_experts", &mxfp4_experts,
        "routed MXFP4 experts of one MoE layer over (token, expert) pairs; the tables are int64 addresses of "
        "tensors the caller keeps alive (layers/blockscaled.py MxFp4Experts)",
        py::arg("x"), py::arg("slots"), py::arg("weights"), py::arg("w1"), py::arg("w1_scale"), py::arg("w3"),
        py::arg("w3_scale"), py::arg("w2"), py::arg("w2_scale"), py::arg("hidden"), py::arg("inter"),
        py::arg("limit"));
  m.def("instruction_set", &instruction_set, "the path this build compiled: avx512_bf16, avx512, avx2, scalar");
}
