// The Llama family's rotary embedding in one pass over a step's q and k heads: x * cos +
// roll(x, head_dim / 2) * signed_sin, rounded where torch's three ops round (each product,
// then the sum, to the dtype), so it is layers/rotary.py's apply_rotary bit for bit. Built
// on first use by layers/decode_kernel.py with -ffp-contract=off (no fused multiply-adds),
// registered as torch.ops.deepwell_llama_rotary.
//
// Torch runs those ops over a strided bf16 view with a broadcast cos: on a 2,048-row prefill
// chunk of SmolLM2 they took about 14 ms a layer on two threads, as much as a third of the
// chunk's attention; one pass reads each head once.

#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>

#include <type_traits>
#include <vector>

namespace {

// Elements per parallel task: a decode step's few rows stay on the calling thread.
constexpr int64_t kGrainElements = 32768;

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
