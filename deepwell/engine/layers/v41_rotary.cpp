// DeepSeek-V4.1's rotary embedding (models/deepseek_v41/rotary.py holds the torch version):
// the adjacent-pair rotation of a tensor's last `rotary_dim` channels by unit complex numbers,
// one pass a row in place of the dozen torch ops (float copy, complex views, multiply, round
// back, concatenate) a call takes there. Built by layers/decode_kernel.py with
// -ffp-contract=off -fno-tree-vectorize, registered as torch.ops.deepwell_v41_rotary.rotate.
//
//   rotate  values float32 or bfloat16 [rows, ..., dim], rotation complex64 [rows, pairs]
//           (broadcast over the middle axes), rotary_dim = 2 · pairs, inverse (the conjugate)
//           → values' dtype and shape: the first dim - rotary_dim channels copied, each pair
//           (a, b) by (c, d) → (a·c − b·d, a·d + b·c) in float32, rounded to values' dtype.
//
// Bit for bit the torch version: each product is rounded alone and then summed (no fused
// multiply-add: hence the flags), as torch's vectorised complex multiply does; the bfloat16
// rounding is c10's, the one .to(torch.bfloat16) uses
// (tests/engine/models/deepseek_v41/test_rotary.py).

#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/view_as_real.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace {

// Rows per parallel task: a decode step's few rows stay on the calling thread.
constexpr int64_t kGrainRows = 64;

template <typename T>
void rotate_rows(const T* in, T* out, const float* rotation, int64_t rows, int64_t middle,
                 int64_t dim, int64_t pairs, bool inverse) {
  const int64_t kept = dim - 2 * pairs;
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* turn = rotation + row * 2 * pairs;
      for (int64_t m = 0; m < middle; ++m) {
        const int64_t offset = (row * middle + m) * dim;
        const T* src = in + offset;
        T* dst = out + offset;
        for (int64_t c = 0; c < kept; ++c) dst[c] = src[c];
        const T* pair = src + kept;
        T* rotated = dst + kept;
        for (int64_t p = 0; p < pairs; ++p) {
          const float a = static_cast<float>(pair[2 * p]);
          const float b = static_cast<float>(pair[2 * p + 1]);
          const float c = turn[2 * p];
          const float d = inverse ? -turn[2 * p + 1] : turn[2 * p + 1];
          rotated[2 * p] = static_cast<T>(a * c - b * d);
          rotated[2 * p + 1] = static_cast<T>(a * d + b * c);
        }
      }
    }
  });
}

at::Tensor rotate(const at::Tensor& values_in, const at::Tensor& rotation_in, int64_t rotary_dim,
                  bool inverse) {
  TORCH_CHECK(values_in.dim() >= 2, "deepwell_v41_rotary: values must be [rows, ..., dim], got ",
              values_in.sizes());
  TORCH_CHECK(values_in.scalar_type() == at::kFloat || values_in.scalar_type() == at::kBFloat16,
              "deepwell_v41_rotary: values must be float32 or bfloat16, got ",
              values_in.scalar_type());
  const int64_t rows = values_in.size(0), dim = values_in.size(-1), pairs = rotary_dim / 2;
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim > 0 && rotary_dim <= dim,
              "deepwell_v41_rotary: rotary_dim ", rotary_dim, " must be even and within dim ", dim);
  TORCH_CHECK(rotation_in.scalar_type() == at::kComplexFloat && rotation_in.dim() == 2 &&
                  rotation_in.size(0) == rows && rotation_in.size(1) == pairs,
              "deepwell_v41_rotary: rotation must be complex64 [", rows, ", ", pairs, "], got ",
              rotation_in.scalar_type(), " ", rotation_in.sizes());
  TORCH_CHECK(values_in.device().is_cpu() && rotation_in.device().is_cpu(),
              "deepwell_v41_rotary: tensors must be on the CPU");
  const at::Tensor values = values_in.contiguous();
  const at::Tensor rotation = at::view_as_real(rotation_in.resolve_conj()).contiguous();
  at::Tensor out = at::empty_like(values);
  const int64_t middle = rows ? values.numel() / (rows * dim) : 0;
  const float* turn = rotation.data_ptr<float>();
  if (values.scalar_type() == at::kFloat) {
    rotate_rows(values.data_ptr<float>(), out.data_ptr<float>(), turn, rows, middle, dim, pairs,
                inverse);
  } else {
    rotate_rows(values.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), turn, rows, middle,
                dim, pairs, inverse);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(deepwell_v41_rotary, m) {
  m.def("rotate(Tensor values, Tensor rotation, int rotary_dim, bool inverse) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepwell_v41_rotary, CPU, m) { m.impl("rotate", &rotate); }
