// The Llama family's rotary embedding in one pass over a step's q and k heads: x * cos +
// roll(x, head_dim / 2) * signed_sin, rounded where torch's three ops round (each product,
// then the sum, to the dtype), so it is layers/rotary.py's apply_rotary bit for bit. Built
// on first use by layers/decode_kernel.py with -ffp-contract=off (no fused multiply-adds),
// registered as torch.ops.deepwell_llama_rotary.
//
// Torch runs those ops over a strided bf16 view with a broadcast cos: on a 2,048-row prefill
// chunk of SmolLM2 they took about 14 ms a layer on two threads, as much as a third of the
// chunk's attention; one pass reads each head once. Heads of two whole vector pairs
// (SmolLM2's 64 on AVX-512) run in registers (rotate_rows_vectors): 0.19 ms a 1,000-token
// chunk of SmolLM2's 12 q and k heads on one AMX Xeon thread, against 0.57 for the portable
// pass through scratch (benchmarks/glue_kernels.py).

#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>

#include <tuple>
#include <type_traits>
#include <vector>

#include "kernel_parts.h"

namespace {

using Vec = at::vec::Vectorized<float>;

// Elements per parallel task: a decode step's few rows stay on the calling thread.
constexpr int64_t kGrainElements = 32768;
// Widest head whose cos and sin the vector pass holds (widened) on the stack.
constexpr int64_t kMaxVectorDim = 512;

#if defined(CPU_CAPABILITY_AVX512)
// v rounded to bf16 and widened back, without the pack and unpack between: bits u become
// (u + 0x7fff + lsb) with the low 16 bits cleared, any NaN 0xffff0000 (0xffff widened) --
// what at::vec's cvtfp32_bf16 and its widening give, lane for lane (its sum cannot carry
// out of 32 bits for a non-NaN, so its unsigned pack never saturates).
inline Vec round_through_bf16(const Vec& v) {
  const __m512 f = v;
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i biased = _mm512_add_epi32(_mm512_add_epi32(u, lsb), _mm512_set1_epi32(0x7fff));
  const __mmask16 ordered = _mm512_cmp_ps_mask(f, f, _CMP_ORD_Q);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  return _mm512_castsi512_ps(_mm512_mask_and_epi32(high, ordered, biased, high));
}
#endif

// A pair of vectors rounded through T and back: the rounding torch's op applies to its
// output. at::vec's own pair conversion otherwise, the one at::vec::convert applies to whole
// vectors (on AVX2 too: round to nearest even, any NaN to 0xffff), so the bits are the
// portable pass's, NaN and inf included.
template <typename T>
void round_through(Vec& lo, Vec& hi) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(CPU_CAPABILITY_AVX512)
    lo = round_through_bf16(lo);
    hi = round_through_bf16(hi);
    return;
#endif
  }
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(lo, hi));
  }
}

using deepwell::load_pair;

// out[0, 2 * Vec::size()) = x * cos + rolled * sin, each product rounded through T, then the
// sum: the portable pass's operations on the same elements, in registers.
template <typename T>
void rotate_pair(const std::tuple<Vec, Vec>& x, const std::tuple<Vec, Vec>& rolled,
                 const float* cos, const float* sin, T* out) {
  const auto& [x_lo, x_hi] = x;
  const auto& [r_lo, r_hi] = rolled;
  Vec a_lo = x_lo * Vec::loadu(cos), a_hi = x_hi * Vec::loadu(cos + Vec::size());
  Vec b_lo = r_lo * Vec::loadu(sin), b_hi = r_hi * Vec::loadu(sin + Vec::size());
  round_through<T>(a_lo, a_hi);
  round_through<T>(b_lo, b_hi);
  const Vec sum_lo = a_lo + b_lo, sum_hi = a_hi + b_hi;
  if constexpr (std::is_same_v<T, float>) {
    sum_lo.store(out);
    sum_hi.store(out + Vec::size());
  } else {
    at::vec::convert_from_float<T>(sum_lo, sum_hi).store(out);
  }
}

// The pass in registers, for half a head a multiple of two vectors: the roll is then a swap
// of whole vector pairs, each pair of the head loaded (and widened) once and used twice.
// cos and sin are widened once a token (exactly).
template <typename T>
void rotate_rows_vectors(
    const T* x,
    int64_t x_row,
    const T* cos,
    const T* sin,
    T* out,
    int64_t tokens,
    int64_t heads,
    int64_t dim) {
  constexpr int64_t kPair = 2 * Vec::size();
  const int64_t half = dim / 2;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / (heads * dim));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float c[kMaxVectorDim], s[kMaxVectorDim];
    for (int64_t t = begin; t < end; ++t) {
      at::vec::convert(cos + t * dim, c, dim);
      at::vec::convert(sin + t * dim, s, dim);
      for (int64_t h = 0; h < heads; ++h) {
        const T* head = x + t * x_row + h * dim;
        T* o = out + (t * heads + h) * dim;
        for (int64_t d = 0; d < half; d += kPair) {
          // Element d's rolled partner is d + half, and d + half's is d.
          const auto first = load_pair(head + d);
          const auto second = load_pair(head + d + half);
          rotate_pair(first, second, c + d, s + d, o + d);
          rotate_pair(second, first, c + d + half, s + d + half, o + d + half);
        }
      }
    }
  });
}

template <typename T>
void rotate_rows(
    const T* x,
    int64_t x_row,
    const T* cos,
    const T* sin,
    T* out,
    int64_t tokens,
    int64_t heads,
    int64_t dim) {
  if (dim % (4 * Vec::size()) == 0 && dim <= kMaxVectorDim) {
    rotate_rows_vectors(x, x_row, cos, sin, out, tokens, heads, dim);
    return;
  }
  // The portable pass, for any even head_dim.
  const int64_t half = dim / 2;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / (heads * dim));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> c(dim), s(dim), xf(dim), a(dim), b(dim);
    std::vector<T> rounded(dim);
    // Through the dtype and back: the rounding torch's op applies to its output.
    auto round = [&](std::vector<float>& v) {
      if constexpr (!std::is_same_v<T, float>) {
        at::vec::convert(v.data(), rounded.data(), dim);
        at::vec::convert(rounded.data(), v.data(), dim);
      }
    };
    for (int64_t t = begin; t < end; ++t) {
      at::vec::convert(cos + t * dim, c.data(), dim);
      at::vec::convert(sin + t * dim, s.data(), dim);
      for (int64_t h = 0; h < heads; ++h) {
        at::vec::convert(x + t * x_row + h * dim, xf.data(), dim);
        for (int64_t d = 0; d < dim; ++d) a[d] = xf[d] * c[d];
        for (int64_t d = 0; d < half; ++d) b[d] = xf[d + half] * s[d];
        for (int64_t d = half; d < dim; ++d) b[d] = xf[d - half] * s[d];
        round(a);
        round(b);
        for (int64_t d = 0; d < dim; ++d) a[d] = a[d] + b[d];
        at::vec::convert(a.data(), out + (t * heads + h) * dim, dim);
      }
    }
  });
}

// x [tokens, heads, dim] (heads contiguous within a row, any row stride); cos and signed_sin
// [tokens, 1, dim] contiguous, as RotaryEmbedding.lookup gives them; all of one dtype,
// float32 or bfloat16. Returns a new contiguous [tokens, heads, dim].
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3, "llama rotary: x must be [tokens, heads, head_dim], got ", x.sizes());
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "llama rotary: head_dim must be even, got ", dim);
  TORCH_CHECK(
      x.stride(2) == 1 && (heads == 1 || x.stride(1) == dim),
      "llama rotary: x's heads must be contiguous within a row");
  for (const at::Tensor* table : {&cos, &signed_sin}) {
    TORCH_CHECK(
        table->dim() == 3 && table->size(0) == tokens && table->size(1) == 1 &&
            table->size(2) == dim && table->is_contiguous(),
        "llama rotary: cos and signed_sin must be contiguous [", tokens, ", 1, ", dim,
        "], got ", table->sizes());
    TORCH_CHECK(table->scalar_type() == x.scalar_type(),
                "llama rotary: cos and signed_sin must be x's dtype ", x.scalar_type());
  }
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  if (tokens == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    rotate_rows(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(),
                signed_sin.data_ptr<float>(), out.data_ptr<float>(), tokens, heads, dim);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16,
                "llama rotary: x must be float32 or bfloat16, got ", x.scalar_type());
    rotate_rows(x.data_ptr<at::BFloat16>(), x.stride(0), cos.data_ptr<at::BFloat16>(),
                signed_sin.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), tokens,
                heads, dim);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(deepwell_llama_rotary, m) {
  m.def("rotate(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepwell_llama_rotary, CPU, m) {
  m.impl("rotate", &rotate);
}
