// The Llama-family torch path's elementwise glue, fused: residual add + RMSNorm in one pass
// over a row, and silu(gate) * up straight from the fused gate_up output. Built into the
// decode attention extension (layers/decode_kernel.py) and registered as torch ops
// (torch.ops.deepwell_glue.*), so it needs no module of its own; layers/fused_glue.py calls it.
//
// Each row is computed alone, in float32, in a fixed order: a row's result does not depend on
// how many rows share the step (batch invariant), only on this build's vector width.

#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernel_parts.h"

namespace {

using Vec = at::vec::Vectorized<float>;

// Elements per parallel task: a step of a few rows stays on the calling thread, where
// OpenMP's fork would cost more than the work.
constexpr int64_t kGrainElements = 32768;

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainElements / width); }

template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  at::vec::convert(src, dst, n);
}

template <typename T>
void from_float(const float* src, T* dst, int64_t n) {
  at::vec::convert(src, dst, n);
}

// The register passes below stand in for the scratch passes on rows of whole vector pairs,
// with their bits (tests/engine/layers/test_fused_glue.py: silu against the scratch pass, the
// norm against a model of its sum), taken on x86's vector builds only, where those bits were
// checked. One NaN may differ: where residual and delta are both NaN, the stored sum may carry
// the delta's payload (x86's add keeps its first operand's; the compiler orders them).
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kVectorBuild = true;
#else
constexpr bool kVectorBuild = false;
#endif
constexpr int64_t kPair = 2 * Vec::size();

bool in_register_pairs(int64_t width) { return kVectorBuild && width % kPair == 0; }

// silu's register pass only where it measured faster: at AVX2 (16 registers for exp_u20's
// constants and two vectors in flight) a 55-row step took 50 us against the scratch pass's 47.
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kSiluInRegisters = true;
#else
constexpr bool kSiluInRegisters = false;
#endif

using deepwell::load_pair;

// lo, hi to dst[0, kPair) as T: bf16 rounds as at::vec::convert does whole vectors.
template <typename T>
void store_pair(const Vec& lo, const Vec& hi, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    lo.store(dst);
    hi.store(dst + Vec::size());
  } else {
    at::vec::convert_from_float<T>(lo, hi).store(dst);
  }
}

// One row of add_rms_norm_rows in two passes over registers instead of five over scratch:
// the add, stored, with its squares summed as rms_norm_row's map_reduce_all sums them (one
// accumulator: the first square, then a fused multiply-add a vector, which is what gcc makes
// of that loop under C++'s default -ffp-contract=fast), then the scaling and rounding.
template <typename D, typename O>
void add_rms_norm_row_pairs(
    float* x, const D* delta, const float* weight, float eps, O* out, int64_t width) {
  Vec sum_squares;
  for (int64_t i = 0; i < width; i += kPair) {
    auto [lo, hi] = load_pair(x + i);
    if (delta != nullptr) {
      const auto [d_lo, d_hi] = load_pair(delta + i);
      lo = lo + d_lo;
      hi = hi + d_hi;
      store_pair(lo, hi, x + i);
    }
    sum_squares = i == 0 ? lo * lo : at::vec::fmadd(lo, lo, sum_squares);
    sum_squares = at::vec::fmadd(hi, hi, sum_squares);
  }
  const float sum =
      at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, sum_squares);
  const Vec inverse(1.f / std::sqrt(sum / static_cast<float>(width) + eps));
  for (int64_t i = 0; i < width; i += kPair) {
    const auto [lo, hi] = load_pair(x + i);
    const auto [w_lo, w_hi] = load_pair(weight + i);
    store_pair(lo * inverse * w_lo, hi * inverse * w_hi, out + i);
  }
}

// residual[r] += delta[r] (when given); out[r] = residual[r] * rsqrt(mean(residual[r]^2) + eps)
// * weight, in the order torch's rms_norm composes it.
template <typename D, typename O>
void add_rms_norm_rows(
    float* residual,
    const D* delta,
    const float* weight,
    float eps,
    O* out,
    int64_t rows,
    int64_t width) {
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    if (in_register_pairs(width)) {
      for (int64_t r = begin; r < end; ++r) {
        const D* delta_row = delta == nullptr ? nullptr : delta + r * width;
        add_rms_norm_row_pairs(residual + r * width, delta_row, weight, eps, out + r * width,
                               width);
      }
      return;
    }
    std::vector<float> delta_row(delta == nullptr ? 0 : width);
    std::vector<float> normed(std::is_same_v<O, float> ? 0 : width);
    for (int64_t r = begin; r < end; ++r) {
      float* x = residual + r * width;
      if (delta != nullptr) {
        const float* d = delta_row.data();
        if constexpr (std::is_same_v<D, float>) {
          d = delta + r * width;
        } else {
          to_float(delta + r * width, delta_row.data(), width);
        }
        at::vec::map2([](Vec a, Vec b) { return a + b; }, x, x, d, width);
      }
      float* target = std::is_same_v<O, float> ? reinterpret_cast<float*>(out + r * width)
                                               : normed.data();
      deepwell::rms_norm_row(x, weight, width, eps, target);
      if constexpr (!std::is_same_v<O, float>) from_float(normed.data(), out + r * width, width);
    }
  });
}

at::Tensor add_rms_norm(
    at::Tensor residual,
    const std::optional<at::Tensor>& delta,
    const at::Tensor& weight,
    double eps,
    at::ScalarType out_dtype) {
  TORCH_CHECK(
      residual.dim() == 2 && residual.scalar_type() == at::kFloat && residual.is_contiguous(),
      "add_rms_norm: the residual must be a contiguous float32 [rows, hidden] tensor");
  const int64_t rows = residual.size(0), width = residual.size(1);
  TORCH_CHECK(
      weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == width,
      "add_rms_norm: the weight must be a contiguous float32 [hidden] tensor");
  TORCH_CHECK(
      out_dtype == at::kFloat || out_dtype == at::kBFloat16,
      "add_rms_norm: the output dtype must be float32 or bfloat16");
  at::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(
        d.sizes() == residual.sizes() &&
            (d.scalar_type() == at::kFloat || d.scalar_type() == at::kBFloat16),
        "add_rms_norm: the delta must be float32 or bfloat16 and shaped like the residual");
  }
  at::Tensor out = at::empty_like(residual, residual.options().dtype(out_dtype));
  float* x = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  auto run = [&](auto* out_ptr) {
    if (!d.defined()) {
      add_rms_norm_rows<float>(x, nullptr, w, e, out_ptr, rows, width);
    } else if (d.scalar_type() == at::kFloat) {
      add_rms_norm_rows(x, d.data_ptr<float>(), w, e, out_ptr, rows, width);
    } else {
      add_rms_norm_rows(x, d.data_ptr<at::BFloat16>(), w, e, out_ptr, rows, width);
    }
  };
  if (out_dtype == at::kFloat) {
    run(out.data_ptr<float>());
  } else {
    run(out.data_ptr<at::BFloat16>());
  }
  return out;
}

using deepwell::silu_times;

// out[r] = silu(gate[r]) * up[r] with gate_up[r] = [gate | up].
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
    if (!std::is_same_v<T, float> && kSiluInRegisters && in_register_pairs(width)) {
      // Widened, computed and rounded in registers, with no trip through scratch.
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = gate_up + r * 2 * width;
        const T* up = gate + width;
        for (int64_t i = 0; i < width; i += kPair) {
          const auto [g_lo, g_hi] = load_pair(gate + i);
          const auto [u_lo, u_hi] = load_pair(up + i);
          store_pair(silu_times(g_lo, u_lo), silu_times(g_hi, u_hi), out + r * width + i);
        }
      }
      return;
    }
    std::vector<float> gate(width), up(width);
    for (int64_t r = begin; r < end; ++r) {
      const T* row = gate_up + r * 2 * width;
      const float* g = gate.data();
      const float* u = up.data();
      if constexpr (std::is_same_v<T, float>) {
        g = row;
        u = row + width;
      } else {
        to_float(row, gate.data(), width);
        to_float(row + width, up.data(), width);
      }
      float* target = std::is_same_v<T, float> ? reinterpret_cast<float*>(out + r * width)
                                               : gate.data();
      at::vec::map2([](Vec a, Vec b) { return silu_times(a, b); }, target, g, u, width);
      if constexpr (!std::is_same_v<T, float>) from_float(gate.data(), out + r * width, width);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(
      gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 &&
          (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16),
      "silu_mul: gate_up must be a float32 or bfloat16 [rows, 2 * intermediate] tensor");
  at::Tensor input = gate_up.contiguous();
  const int64_t rows = input.size(0), width = input.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, input.options());
  if (input.scalar_type() == at::kFloat) {
    silu_mul_rows(input.data_ptr<float>(), out.data_ptr<float>(), rows, width);
  } else {
    silu_mul_rows(input.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, width);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(deepwell_glue, m) {
  m.def(
      "add_rms_norm(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps, "
      "ScalarType out_dtype) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepwell_glue, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
}
