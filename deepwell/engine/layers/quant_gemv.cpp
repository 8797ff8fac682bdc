// Decode linears on GGUF blocks: Q4_1 or Q8_0 weights times activations quantised per
// 32-block to int8 (llama.cpp's q8_1), for calls of a few rows; built by decode_kernel.py.
//
// Weight layouts (repacked at load by layers/quant_linear.py), N output rows, B blocks of 32
// inputs per row, B even (a zero block pads an odd count):
//   Q4_1: nibbles uint8 [N, B/2, 32], byte j of pair p = q[2p][j] | q[2p+1][j] << 4, so one
//         32-byte load and two masks give two whole blocks in input order; d, m float [N, B]
//         (w = d * q + m, q in 0..15).
//   Q8_0: q int8 [N, B, 32]; d float [N, B] (w = d * q); m float [N, B] = -128 d Σ q, the
//         correction of the VNNI path, which multiplies q by x + 128 (unsigned).
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
// Lane i of the result: the sum of v[i]'s 16 lanes (as paged_decode.cpp's sum_lanes16): 16
// output rows reduced together for the cost of about two horizontal sums.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(
        _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 low = _mm512_add_ps(
      _mm512_shuffle_f32x4(quads[0], quads[1], kEven), _mm512_shuffle_f32x4(quads[0], quads[1], kOdd));
  const __m512 high = _mm512_add_ps(
      _mm512_shuffle_f32x4(quads[2], quads[3], kEven), _mm512_shuffle_f32x4(quads[2], quads[3], kOdd));
  return _mm512_add_ps(
      _mm512_shuffle_f32x4(low, high, kEven), _mm512_shuffle_f32x4(low, high, kOdd));
}

// Output rows [begin, end) for R activation rows, 16 output rows at a time. Each row's 16
// float lanes start at its offset term (Σ m t, 16 blocks a vector: t = sx for Q4_1, dx for
// Q8_0) and take each pair of blocks as d dx (lanes 0-7: block 2p, 8-15: 2p+1) times the
// vpdpbusd sums; the tile's lanes are then summed together and stored as one vector a row.
template <int R, bool kQ4_1>
void rows_vnni(
    const uint8_t* weights, const float* wd, const float* wm, const Activations& a,
    int64_t begin, int64_t end, int64_t out_features, float* out) {
  const int64_t blocks = a.blocks, pairs = blocks / 2;
  const int64_t row_bytes = kQ4_1 ? pairs * kBlock : blocks * kBlock;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const float* offset_factor = kQ4_1 ? a.s.data() : a.d.data();
  const uint8_t* x_bytes = kQ4_1 ? reinterpret_cast<const uint8_t*>(a.q.data()) : a.unsigned_q.data();
  __m512 tile[R][16];
  for (int64_t first = begin; first < end; first += 16) {
    const int64_t count = std::min<int64_t>(16, end - first);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t o = first + i;
      const float* m = wm + o * blocks;
      __m512 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; b += 16) {
        const __mmask16 valid = blocks - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (blocks - b)) - 1);
        const __m512 mv = _mm512_maskz_loadu_ps(valid, m + b);
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(valid, offset_factor + r * blocks + b), acc[r]);
        }
      }
      const uint8_t* w_row = weights + o * row_bytes;
      const float* d = wd + o * blocks;
      for (int64_t p = 0; p < pairs; ++p) {
        __m512i w;
        if constexpr (kQ4_1) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w_row + p * kBlock));
          w = _mm512_inserti64x4(
              _mm512_castsi256_si512(_mm256_and_si256(packed, low)),
              _mm256_and_si256(_mm256_srli_epi16(packed, 4), low), 1);
        } else {
          w = _mm512_loadu_si512(w_row + 2 * p * kBlock);
        }
        const __m512 scale = _mm512_permutexvar_ps(
            pick, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d + 2 * p)))));
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
      _mm512_mask_storeu_ps(out + r * out_features + first, stored, sum_lanes16(tile[r]));
    }
  }
}
#else
// Σ a[i] b[i] over n floats: the Q4_1 offset term Σ_b m[b] sx[b] of one output row.
inline float dot_floats(const float* a, const float* b, int64_t n) {
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += a[i] * b[i];
  return total;
}
#endif

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

#if defined(QUANT_VNNI)
template <int R>
void q4_1_rows(
    const uint8_t* nibbles, const float* d, const float* m, const Activations& a,
    int64_t begin, int64_t end, int64_t out_features, float* out) {
  rows_vnni<R, true>(nibbles, d, m, a, begin, end, out_features, out);
}

template <int R>
void q8_0_rows(
    const int8_t* q, const float* d, const float* m, const Activations& a, int64_t begin,
    int64_t end, int64_t out_features, float* out) {
  rows_vnni<R, false>(reinterpret_cast<const uint8_t*>(q), d, m, a, begin, end, out_features, out);
}
#else
// One output row's dot with each of the R activation rows, out[r] (Q4_1).
template <int R>
inline void q4_1_row(const uint8_t* nibbles, const float* wd, const Activations& a, float* out) {
  const int64_t blocks = a.blocks;
#if defined(QUANT_AVX2)
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t p = 0; p < blocks / 2; ++p) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + p * kBlock));
    const __m256i w0 = _mm256_and_si256(packed, low);
    const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.q.data() + (r * blocks + 2 * p) * kBlock;
      const float* dx = a.d.data() + r * blocks + 2 * p;
      const __m256 dot0 = dot_u8s8(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
      const __m256 dot1 = dot_u8s8(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + kBlock)));
      acc[r] = _mm256_fmadd_ps(dot0, _mm256_set1_ps(wd[2 * p] * dx[0]), acc[r]);
      acc[r] = _mm256_fmadd_ps(dot1, _mm256_set1_ps(wd[2 * p + 1] * dx[1]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sum_lanes(acc[r]);
#else
  for (int r = 0; r < R; ++r) out[r] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* pair = nibbles + (b / 2) * kBlock;
    const int shift = (b % 2) * 4;
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.q.data() + (r * blocks + b) * kBlock;
      int32_t dot = 0;
      for (int64_t j = 0; j < kBlock; ++j) dot += ((pair[j] >> shift) & 0x0F) * x[j];
      out[r] += wd[b] * a.d[r * blocks + b] * static_cast<float>(dot);
    }
  }
#endif
}

// One output row's dot with each of the R activation rows, out[r] (Q8_0). The int8 × int8
// products go through the u8 × s8 instructions as |w| × (x with w's sign).
template <int R>
inline void q8_0_row(const int8_t* q, const float* wd, const Activations& a, float* out) {
  const int64_t blocks = a.blocks;
#if defined(QUANT_AVX2)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock));
    const __m256i magnitude = _mm256_abs_epi8(w);
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(a.q.data() + (r * blocks + b) * kBlock));
      const __m256 dot = dot_u8s8(magnitude, _mm256_sign_epi8(x, w));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(wd[b] * a.d[r * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sum_lanes(acc[r]);
#else
  for (int r = 0; r < R; ++r) out[r] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.q.data() + (r * blocks + b) * kBlock;
      int32_t dot = 0;
      for (int64_t j = 0; j < kBlock; ++j) dot += q[b * kBlock + j] * x[j];
      out[r] += wd[b] * a.d[r * blocks + b] * static_cast<float>(dot);
    }
  }
#endif
}

template <int R>
void q4_1_rows(
    const uint8_t* nibbles, const float* d, const float* m, const Activations& a,
    int64_t begin, int64_t end, int64_t out_features, float* out) {
  const int64_t blocks = a.blocks;
  float sums[R];
  for (int64_t o = begin; o < end; ++o) {
    q4_1_row<R>(nibbles + o * blocks / 2 * kBlock, d + o * blocks, a, sums);
    for (int r = 0; r < R; ++r) {
      out[r * out_features + o] = sums[r] + dot_floats(m + o * blocks, a.s.data() + r * blocks, blocks);
    }
  }
}

// `m` (the VNNI path's correction for its unsigned x + 128) is not read: this path
// multiplies signed values directly.
template <int R>
void q8_0_rows(
    const int8_t* q, const float* d, const float*, const Activations& a, int64_t begin,
    int64_t end, int64_t out_features, float* out) {
  const int64_t blocks = a.blocks;
  float sums[R];
  for (int64_t o = begin; o < end; ++o) {
    q8_0_row<R>(q + o * blocks * kBlock, d + o * blocks, a, sums);
    for (int r = 0; r < R; ++r) out[r * out_features + o] = sums[r];
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

torch::Tensor q4_1_linear(
    const torch::Tensor& x, const torch::Tensor& nibbles, const torch::Tensor& d,
    const torch::Tensor& m) {
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.dim() == 3 && nibbles.size(2) == kBlock,
              "nibbles must be uint8 [out, blocks / 2, 32]");
  TORCH_CHECK(nibbles.is_contiguous() && d.is_contiguous() && m.is_contiguous(), "weights must be contiguous");
  const int64_t out_features = nibbles.size(0), blocks = 2 * nibbles.size(1);
  TORCH_CHECK(d.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat, "d and m must be float32");
  TORCH_CHECK(d.numel() == out_features * blocks && m.numel() == out_features * blocks, "d and m must be [out, blocks]");
  const Activations a = quantize_input(x, blocks);
  const uint8_t* w = nibbles.data_ptr<uint8_t>();
  const float* wd = d.data_ptr<float>();
  const float* wm = m.data_ptr<float>();
  const int64_t rows = x.size(0);
  return run_rows(x, out_features, [&](int64_t begin, int64_t end, float* out) {
    DISPATCH_ROWS(rows, q4_1_rows, w, wd, wm, a, begin, end, out_features, out)
  });
}

torch::Tensor q8_0_linear(
    const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
    const torch::Tensor& m) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 3 && q.size(2) == kBlock,
              "q must be int8 [out, blocks, 32]");
  TORCH_CHECK(q.size(1) % 2 == 0, "q must have an even number of blocks");
  TORCH_CHECK(q.is_contiguous() && d.is_contiguous() && m.is_contiguous(), "weights must be contiguous");
  const int64_t out_features = q.size(0), blocks = q.size(1);
  TORCH_CHECK(d.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat, "d and m must be float32");
  TORCH_CHECK(d.numel() == out_features * blocks && m.numel() == out_features * blocks, "d and m must be [out, blocks]");
  const Activations a = quantize_input(x, blocks);
  const int8_t* w = q.data_ptr<int8_t>();
  const float* wd = d.data_ptr<float>();
  const float* wm = m.data_ptr<float>();
  const int64_t rows = x.size(0);
  return run_rows(x, out_features, [&](int64_t begin, int64_t end, float* out) {
    DISPATCH_ROWS(rows, q8_0_rows, w, wd, wm, a, begin, end, out_features, out)
  });
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
      DISPATCH_ROWS(rows, q4_1_rows, w.q, w.d, w.m, a, begin, end, out_features, out)
    } else {
      const int8_t* q = reinterpret_cast<const int8_t*>(w.q);
      DISPATCH_ROWS(rows, q8_0_rows, q, w.d, w.m, a, begin, end, out_features, out)
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
