// Decode linears on GGUF blocks: Q4_1 or Q8_0 weights times activations quantised per
// 32-block to int8 (llama.cpp's q8_1), for calls of a few rows; built by decode_kernel.py.
//
// Weight layout (repacked at load by layers/quant_linear.py): one uint8 row per output
// feature, B blocks of 32 inputs (B even: a zero block pads an odd count), everything a row
// needs in one stream:
//   Q4_1 (w = d q + m, q in 0..15), 20 B bytes: B/2 pairs of 32 bytes, byte j of pair p =
//         q[2p][j] | q[2p+1][j] << 4 (one 32-byte load and two masks give two whole blocks in
//         input order), then fp16 d[B], then fp16 m[B].
//   Q8_0 (w = d q, q int8), 36 B bytes: q[B][32], then fp16 d[B], then int16 Σq[B], for the
//         VNNI path, which multiplies q by x + 128 (unsigned) and takes 128 d Σq back out.
// The scales are GGUF's fp16: a decode step streams every weight, and bytes are its time.
// Activations: per row and block, dx = amax / 127, qx = round(x / dx), sx = dx * Σ qx; then
//   Q4_1: Σ w x ≈ d dx Σ q qx + m sx,   Q8_0: Σ w x ≈ d dx Σ q qx,
// with the integer sums exact in int32 and the rest in float32.
//
// The instruction set is fixed at compile time: AVX-512 VNNI (vpdpbusd: 64 u8 × s8 products
// summed in fours into 16 int32 lanes), else AVX2 (vpmaddubsw + vpmaddwd), else scalar C++.
// DEEPWELL_QUANT_AVX2 / DEEPWELL_QUANT_SCALAR force the lower paths (tests build each).

#include <torch/extension.h>

#include "kernel_parts.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if !defined(DEEPWELL_QUANT_SCALAR) && !defined(DEEPWELL_QUANT_AVX2) && \
    defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QUANT_VNNI 1
#elif !defined(DEEPWELL_QUANT_SCALAR) && defined(__AVX2__) && defined(__FMA__)
#define QUANT_AVX2 1
#endif

#if defined(QUANT_VNNI) || defined(QUANT_AVX2)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_1Bytes = deepwell::kQ4_1BlockBytes;  // 16 + 2 + 2
constexpr int64_t kQ8_0Bytes = deepwell::kQ8_0BlockBytes;  // 32 + 2 + 2

inline float half_to_float(const uint8_t* bytes) {
  uint16_t bits;
  std::memcpy(&bits, bytes, sizeof bits);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline int16_t load_int16(const uint8_t* bytes) {
  int16_t value;
  std::memcpy(&value, bytes, sizeof value);
  return value;
}
// Rows per call the kernels are instantiated for (register-held accumulators per row).
constexpr int64_t kMaxRows = 8;

struct Activations {
  int64_t blocks = 0;  // B, padded even
  std::vector<int8_t> q;  // [rows, B * 32]
  std::vector<float> d;  // [rows, B]
  std::vector<float> s;  // [rows, B]: d * Σ q
#if defined(QUANT_VNNI)
  std::vector<uint8_t> unsigned_q;  // q + 128, for Q8_0 weights (s8) as vpdpbusd's s8 side
  std::vector<float> lanes;  // [rows, B / 2, 16]: d of block 2p in lanes 0-7, 2p+1 in 8-15
#endif
};

template <typename T>
Activations quantize_activations(const T* x, int64_t rows, int64_t in_features, int64_t blocks) {
  Activations a;
  a.blocks = blocks;
  a.q.assign(rows * blocks * kBlock, 0);
  a.d.assign(rows * blocks, 0.f);
  a.s.assign(rows * blocks, 0.f);
  const int64_t real_blocks = in_features / kBlock;
  float values[kBlock];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < real_blocks; ++b) {
      const T* src = x + r * in_features + b * kBlock;
      float amax = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) {
        values[j] = static_cast<float>(src[j]);
        amax = std::max(amax, std::abs(values[j]));
      }
      const float d = amax / 127.f;
      const float inverse = d > 0.f ? 1.f / d : 0.f;
      int8_t* q = a.q.data() + (r * blocks + b) * kBlock;
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        // Ties to even (the default rounding mode), as torch.round in the tests' reference.
        q[j] = static_cast<int8_t>(std::nearbyint(values[j] * inverse));
        sum += q[j];
      }
      a.d[r * blocks + b] = d;
      a.s[r * blocks + b] = d * static_cast<float>(sum);
    }
  }
#if defined(QUANT_VNNI)
  a.unsigned_q.resize(a.q.size());
  for (size_t i = 0; i < a.q.size(); ++i) a.unsigned_q[i] = static_cast<uint8_t>(a.q[i] + 128);
  a.lanes.resize(rows * blocks * 8);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      std::fill_n(a.lanes.data() + (r * blocks + b) * 8, 8, a.d[r * blocks + b]);
    }
  }
#endif
  return a;
}

#if defined(QUANT_VNNI)

// Output rows [begin, end) for R activation rows, 16 output rows at a time. Each row's 16
// float lanes start at its offset term (16 blocks a vector: m sx for Q4_1, -128 d Σq dx for
// Q8_0) and take each pair of blocks as d dx (lanes 0-7: block 2p, 8-15: 2p+1) times the
// vpdpbusd sums; the tile's lanes are then summed together and stored as one vector a row.
// Rows ahead whose bytes are prefetched: the weights stream from memory once a step.
constexpr int64_t kPrefetchRows = 8;

template <int R, bool kQ4_1>
void rows_vnni(
    const uint8_t* weights, const Activations& a, int64_t begin, int64_t end,
    int64_t out_features, float* out) {
  const int64_t blocks = a.blocks, pairs = blocks / 2;
  const int64_t quant_bytes = kQ4_1 ? pairs * kBlock : blocks * kBlock;
  const int64_t row_bytes = blocks * (kQ4_1 ? kQ4_1Bytes : kQ8_0Bytes);
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const float* offset_factor = kQ4_1 ? a.s.data() : a.d.data();
  const uint8_t* x_bytes = kQ4_1 ? reinterpret_cast<const uint8_t*>(a.q.data()) : a.unsigned_q.data();
  __m512 tile[R][16];
  for (int64_t first = begin; first < end; first += 16) {
    const int64_t count = std::min<int64_t>(16, end - first);
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t* row = weights + (first + i) * row_bytes;
      for (int64_t line = 0; line < row_bytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * row_bytes + line), _MM_HINT_T0);
      }
      const uint8_t* d = row + quant_bytes;  // fp16 [B]
      const uint8_t* extra = d + 2 * blocks;  // Q4_1: fp16 m [B]; Q8_0: int16 Σq [B]
      __m512 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; b += 16) {
        const __mmask16 valid = blocks - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (blocks - b)) - 1);
        const __m256i raw = _mm256_maskz_loadu_epi16(valid, extra + 2 * b);
        __m512 offset;
        if constexpr (kQ4_1) {
          offset = _mm512_cvtph_ps(raw);
        } else {
          const __m512 sums = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(raw));
          const __m512 scales = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, d + 2 * b));
          offset = _mm512_mul_ps(_mm512_mul_ps(scales, sums), _mm512_set1_ps(-128.f));
        }
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_fmadd_ps(offset, _mm512_maskz_loadu_ps(valid, offset_factor + r * blocks + b), acc[r]);
        }
      }
      for (int64_t p = 0; p < pairs; ++p) {
        __m512i w;
        if constexpr (kQ4_1) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + p * kBlock));
          w = _mm512_inserti64x4(
              _mm512_castsi256_si512(_mm256_and_si256(packed, low)),
              _mm256_and_si256(_mm256_srli_epi16(packed, 4), low), 1);
        } else {
          w = _mm512_loadu_si512(row + 2 * p * kBlock);
        }
        int32_t two_halves;
        std::memcpy(&two_halves, d + 4 * p, sizeof two_halves);
        const __m512 scale = _mm512_permutexvar_ps(
            pick, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(two_halves))));
        for (int r = 0; r < R; ++r) {
          const __m512i x = _mm512_loadu_si512(x_bytes + (r * blocks + 2 * p) * kBlock);
          // vpdpbusd takes its first operand unsigned: Q4_1's nibbles, or Q8_0's x + 128.
          const __m512i dot = kQ4_1 ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x)
                                    : _mm512_dpbusd_epi32(_mm512_setzero_si512(), x, w);
          const __m512 dx = _mm512_loadu_ps(a.lanes.data() + (r * blocks + 2 * p) * 8);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, dx), acc[r]);
        }
      }
      for (int r = 0; r < R; ++r) tile[r][i] = acc[r];
    }
    const __mmask16 stored = count == 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
    for (int r = 0; r < R; ++r) {
      for (int64_t i = count; i < 16; ++i) tile[r][i] = _mm512_setzero_ps();
      _mm512_mask_storeu_ps(out + r * out_features + first, stored, deepwell::sum_lanes16(tile[r]));
    }
  }
}

template <int R>
void q4_1_rows(const uint8_t* w, const Activations& a, int64_t begin, int64_t end, int64_t n, float* out) {
  rows_vnni<R, true>(w, a, begin, end, n, out);
}

template <int R>
void q8_0_rows(const uint8_t* w, const Activations& a, int64_t begin, int64_t end, int64_t n, float* out) {
  rows_vnni<R, false>(w, a, begin, end, n, out);
}
#else
#if defined(QUANT_AVX2)
inline float sum_lanes(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// u8 × s8 products of 32 lanes summed in fours into 8 int32 lanes, as float. Neither
// operand here reaches vpmaddubsw's int16 saturation: |u| ≤ 128 and |s| ≤ 127.
inline __m256 dot_u8s8(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

// One output row (`row`, the layout above) against each of the R activation rows: out[r].
template <int R>
inline void q4_1_row(const uint8_t* row, const Activations& a, float* out) {
  const int64_t blocks = a.blocks;
  const uint8_t* d = row + blocks / 2 * kBlock;
  const uint8_t* m = d + 2 * blocks;
  for (int r = 0; r < R; ++r) {
    out[r] = 0.f;
    for (int64_t b = 0; b < blocks; ++b) out[r] += half_to_float(m + 2 * b) * a.s[r * blocks + b];
  }
#if defined(QUANT_AVX2)
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t p = 0; p < blocks / 2; ++p) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + p * kBlock));
    const __m256i w0 = _mm256_and_si256(packed, low);
    const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    const float d0 = half_to_float(d + 4 * p), d1 = half_to_float(d + 4 * p + 2);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.q.data() + (r * blocks + 2 * p) * kBlock;
      const float* dx = a.d.data() + r * blocks + 2 * p;
      const __m256 dot0 = dot_u8s8(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
      const __m256 dot1 = dot_u8s8(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + kBlock)));
      acc[r] = _mm256_fmadd_ps(dot0, _mm256_set1_ps(d0 * dx[0]), acc[r]);
      acc[r] = _mm256_fmadd_ps(dot1, _mm256_set1_ps(d1 * dx[1]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] += sum_lanes(acc[r]);
#else
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* pair = row + (b / 2) * kBlock;
    const int shift = (b % 2) * 4;
    const float scale = half_to_float(d + 2 * b);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.q.data() + (r * blocks + b) * kBlock;
      int32_t dot = 0;
      for (int64_t j = 0; j < kBlock; ++j) dot += ((pair[j] >> shift) & 0x0F) * x[j];
      out[r] += scale * a.d[r * blocks + b] * static_cast<float>(dot);
    }
  }
#endif
}

// Q8_0 (Σq is not read: these paths multiply signed values directly; AVX2 as
// |w| × (x with w's sign), since x + 128 would saturate vpmaddubsw).
template <int R>
inline void q8_0_row(const uint8_t* row, const Activations& a, float* out) {
  const int64_t blocks = a.blocks;
  const int8_t* q = reinterpret_cast<const int8_t*>(row);
  const uint8_t* d = row + blocks * kBlock;
#if defined(QUANT_AVX2)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock));
    const __m256i magnitude = _mm256_abs_epi8(w);
    const float scale = half_to_float(d + 2 * b);
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(a.q.data() + (r * blocks + b) * kBlock));
      const __m256 dot = dot_u8s8(magnitude, _mm256_sign_epi8(x, w));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(scale * a.d[r * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sum_lanes(acc[r]);
#else
  for (int r = 0; r < R; ++r) out[r] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const float scale = half_to_float(d + 2 * b);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.q.data() + (r * blocks + b) * kBlock;
      int32_t dot = 0;
      for (int64_t j = 0; j < kBlock; ++j) dot += q[b * kBlock + j] * x[j];
      out[r] += scale * a.d[r * blocks + b] * static_cast<float>(dot);
    }
  }
#endif
}

template <int R>
void q4_1_rows(const uint8_t* w, const Activations& a, int64_t begin, int64_t end, int64_t n, float* out) {
  float sums[R];
  for (int64_t o = begin; o < end; ++o) {
    q4_1_row<R>(w + o * a.blocks * kQ4_1Bytes, a, sums);
    for (int r = 0; r < R; ++r) out[r * n + o] = sums[r];
  }
}

template <int R>
void q8_0_rows(const uint8_t* w, const Activations& a, int64_t begin, int64_t end, int64_t n, float* out) {
  float sums[R];
  for (int64_t o = begin; o < end; ++o) {
    q8_0_row<R>(w + o * a.blocks * kQ8_0Bytes, a, sums);
    for (int r = 0; r < R; ++r) out[r * n + o] = sums[r];
  }
}
#endif

Activations quantize_input(const torch::Tensor& x, int64_t blocks) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, in] matrix");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "x must have 1 to ", kMaxRows, " rows");
  TORCH_CHECK(x.size(1) % kBlock == 0, "in_features must be a multiple of ", kBlock);
  TORCH_CHECK(
      blocks == x.size(1) / kBlock + (x.size(1) / kBlock) % 2,
      "the weight's blocks do not match in_features ", x.size(1));
  if (x.scalar_type() == at::kBFloat16) {
    return quantize_activations(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), blocks);
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
  return quantize_activations(x.data_ptr<float>(), x.size(0), x.size(1), blocks);
}

// Output rows per task: a thread's share is one contiguous slice of the weight.
constexpr int64_t kGrain = 64;

template <typename RowsFn>
torch::Tensor run_rows(const torch::Tensor& x, int64_t out_features, RowsFn rows_fn) {
  auto out = torch::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, out_features, kGrain, [&](int64_t begin, int64_t end) {
    rows_fn(begin, end, dst);
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

#define DISPATCH_ROWS(rows, FN, ...) \
  switch (rows) {                    \
    case 1: FN<1>(__VA_ARGS__); break; \
    case 2: FN<2>(__VA_ARGS__); break; \
    case 3: FN<3>(__VA_ARGS__); break; \
    case 4: FN<4>(__VA_ARGS__); break; \
    case 5: FN<5>(__VA_ARGS__); break; \
    case 6: FN<6>(__VA_ARGS__); break; \
    case 7: FN<7>(__VA_ARGS__); break; \
    default: FN<8>(__VA_ARGS__); break; \
  }

// x [rows, in] @ W.T for `weights` uint8 [out, blocks * bytes_per_block] in the layout above.
torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& weights, bool q4_1) {
  const int64_t bytes_per_block = q4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  TORCH_CHECK(weights.scalar_type() == at::kByte && weights.dim() == 2 && weights.is_contiguous(),
              "weights must be a contiguous uint8 [out, bytes] matrix");
  TORCH_CHECK(weights.size(1) % (2 * bytes_per_block) == 0, "weight rows must hold an even number of blocks");
  const int64_t out_features = weights.size(0), blocks = weights.size(1) / bytes_per_block;
  const Activations a = quantize_input(x, blocks);
  const uint8_t* w = weights.data_ptr<uint8_t>();
  const int64_t rows = x.size(0);
  return run_rows(x, out_features, [&](int64_t begin, int64_t end, float* out) {
    if (q4_1) {
      DISPATCH_ROWS(rows, q4_1_rows, w, a, begin, end, out_features, out)
    } else {
      DISPATCH_ROWS(rows, q8_0_rows, w, a, begin, end, out_features, out)
    }
  });
}

torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& weights) {
  return block_linear(x, weights, true);
}

torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& weights) {
  return block_linear(x, weights, false);
}

}  // namespace

void deepwell::block_linear(
    const float* x, int64_t rows, int64_t in_features, const BlockLinear& w, float* out) {
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "block_linear takes 1 to ", kMaxRows, " rows");
  TORCH_CHECK(w.blocks == in_features / kBlock + (in_features / kBlock) % 2,
              "the weight's blocks do not match in_features ", in_features);
  const Activations a = quantize_activations(x, rows, in_features, w.blocks);
  const int64_t out_features = w.out_features;
  at::parallel_for(0, out_features, kGrain, [&](int64_t begin, int64_t end) {
    if (w.q4_1) {
      DISPATCH_ROWS(rows, q4_1_rows, w.weights, a, begin, end, out_features, out)
    } else {
      DISPATCH_ROWS(rows, q8_0_rows, w.weights, a, begin, end, out_features, out)
    }
  });
}

namespace {

// The activation quantisation the linears apply, for the tests: (q int8 [rows, B * 32],
// d float [rows, B], s float [rows, B]) with B the padded block count.
std::vector<torch::Tensor> quantize_rows(const torch::Tensor& x) {
  const int64_t blocks = x.size(1) / kBlock + (x.size(1) / kBlock) % 2;
  const Activations a = quantize_input(x, blocks);
  const int64_t rows = x.size(0);
  auto q = torch::from_blob(const_cast<int8_t*>(a.q.data()), {rows, blocks * kBlock}, at::kChar).clone();
  auto d = torch::from_blob(const_cast<float*>(a.d.data()), {rows, blocks}, at::kFloat).clone();
  auto s = torch::from_blob(const_cast<float*>(a.s.data()), {rows, blocks}, at::kFloat).clone();
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
  m.def("q4_1_linear", &q4_1_linear, "x @ Q4_1 weight.T, float32 accumulation, x's dtype out (CPU)");
  m.def("q8_0_linear", &q8_0_linear, "x @ Q8_0 weight.T, float32 accumulation, x's dtype out (CPU)");
  m.def("quantize_rows", &quantize_rows, "the linears' activation quantisation, for tests");
  m.def("instruction_set", &instruction_set, "the path this build compiled: avx512_vnni, avx2, scalar");
  m.attr("max_rows") = kMaxRows;
}
#endif
