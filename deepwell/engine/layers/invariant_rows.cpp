// Row-wise products for the batch-invariant mode (layers/batch_invariant.py, spec/deepinfer.md
// §1.6): every result is computed from its own row alone, in one fixed order, whatever the row
// count, so a row's bits never depend on the rows beside it, with no padding to row tiles.
// Built by layers/decode_kernel.py, registered as torch ops (torch.ops.deepwell_invariant.*),
// called by DeepSeek-V4.1's invariant paths.
//
//   linear          x [rows, in] · w [out, in]ᵀ → [rows, out] float32 (x, w float32 or bfloat16);
//   index_scores    Σ_h weights[h]·relu(q_h·k) per row and key, heads in order (the lightning
//                   indexer's scores);
//   sink_attention  a row's heads over its own key slots, softmax with a per-head sink logit.
//
// A dot product runs in 16 float32 lanes added pairwise at the end; exp is std::exp per
// element. Work is split across threads by whole outputs, never inside one. Plain C++ loops:
// -O3 vectorises the lane loops without reordering a sum (no -ffast-math).

#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int kLanes = 16;
// Multiply-adds per parallel task: a decode step's few rows stay on the calling thread.
constexpr int64_t kGrainFlops = 65536;

inline float widen(float x) { return x; }

inline float widen(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Σ a[i]·b[i] in kLanes running sums (element i in lane i % kLanes), added pairwise.
template <typename A, typename B>
float dot(const A* a, const B* b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += widen(a[i + l]) * widen(b[i + l]);
  }
  for (; i < n; ++i) lanes[i % kLanes] += widen(a[i]) * widen(b[i]);
  for (int half = kLanes / 2; half > 0; half /= 2) {
    for (int l = 0; l < half; ++l) lanes[l] += lanes[l + half];
  }
  return lanes[0];
}

int64_t grain(int64_t flops_per_item) {
  return std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(1, flops_per_item));
}

void check_input(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(
      t.device().is_cpu() && t.is_contiguous() && t.dim() == dims &&
          (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
      "deepwell_invariant: ", name, " must be a contiguous float32 or bfloat16 CPU tensor of ",
      dims, " dimensions");
}

template <typename X, typename W>
void linear_rows(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const int64_t rows = x.size(0), in = x.size(1), outputs = w.size(0);
  const X* xs = x.data_ptr<X>();
  const W* ws = w.data_ptr<W>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows * outputs, grain(in), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / outputs, j = item % outputs;
      o[item] = dot(xs + r * in, ws + j * in, in);
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w) {
  check_input(x, "x", 2);
  check_input(w, "w", 2);
  TORCH_CHECK(
      x.size(1) == w.size(1), "deepwell_invariant.linear: x [rows, ", w.size(1), "] expected, got [",
      x.size(0), ", ", x.size(1), "]");
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options().dtype(at::kFloat));
  const bool x_float = x.scalar_type() == at::kFloat, w_float = w.scalar_type() == at::kFloat;
  if (x_float && w_float) linear_rows<float, float>(x, w, out);
  if (x_float && !w_float) linear_rows<float, at::BFloat16>(x, w, out);
  if (!x_float && w_float) linear_rows<at::BFloat16, float>(x, w, out);
  if (!x_float && !w_float) linear_rows<at::BFloat16, at::BFloat16>(x, w, out);
  return out;
}

void check_float(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(
      t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == dims,
      "deepwell_invariant: ", name, " must be a contiguous float32 CPU tensor of ", dims,
      " dimensions");
}

at::Tensor index_scores(const at::Tensor& queries, const at::Tensor& weights, const at::Tensor& keys) {
  check_float(queries, "queries", 3);
  check_float(weights, "weights", 2);
  check_float(keys, "keys", 2);
  const int64_t rows = queries.size(0), heads = queries.size(1), dim = queries.size(2);
  const int64_t entries = keys.size(0);
  TORCH_CHECK(
      weights.size(0) == rows && weights.size(1) == heads && keys.size(1) == dim,
      "deepwell_invariant.index_scores: queries [rows, heads, dim], weights [rows, heads], keys "
      "[entries, dim] expected");
  at::Tensor out = at::empty({rows, entries}, queries.options());
  const float* q = queries.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  const float* k = keys.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows * entries, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / entries, e = item % entries;
      float total = 0.f;
      for (int64_t h = 0; h < heads; ++h) {
        const float score = dot(q + (r * heads + h) * dim, k + e * dim, dim);
        total += w[r * heads + h] * std::max(score, 0.f);
      }
      o[item] = total;
    }
  });
  return out;
}

template <typename Q>
void attend_rows(
    const at::Tensor& q, const at::Tensor& keys, const at::Tensor& valid, const at::Tensor& sinks,
    double scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), slots = keys.size(1);
  const Q* qs = q.data_ptr<Q>();
  const float* ks = keys.data_ptr<float>();
  const bool* vs = valid.data_ptr<bool>();
  const float* sink = sinks.data_ptr<float>();
  Q* o = out.data_ptr<Q>();
  const float factor = static_cast<float>(scale);
  at::parallel_for(0, rows * heads, grain(2 * slots * dim), [&](int64_t begin, int64_t end) {
    std::vector<float> weights(slots);
    std::vector<float> mixed(dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / heads, h = item % heads;
      const Q* query = qs + item * dim;
      const float* row_keys = ks + r * slots * dim;
      const bool* row_valid = vs + r * slots;
      float top = sink[h];
      for (int64_t s = 0; s < slots; ++s) {
        weights[s] = row_valid[s] ? dot(query, row_keys + s * dim, dim) * factor
                                  : -std::numeric_limits<float>::infinity();
        top = std::max(top, weights[s]);
      }
      float total = 0.f;
      std::fill(mixed.begin(), mixed.end(), 0.f);
      for (int64_t s = 0; s < slots; ++s) {
        if (!row_valid[s]) continue;
        const float p = std::exp(weights[s] - top);
        total += p;
        const float* key = row_keys + s * dim;
        for (int64_t d = 0; d < dim; ++d) mixed[d] += p * key[d];
      }
      total += std::exp(sink[h] - top);
      Q* target = o + item * dim;
      for (int64_t d = 0; d < dim; ++d) target[d] = static_cast<Q>(mixed[d] / total);
    }
  });
}

at::Tensor sink_attention(
    const at::Tensor& q, const at::Tensor& keys, const at::Tensor& valid, const at::Tensor& sinks,
    double scale) {
  check_input(q, "q", 3);
  check_float(keys, "keys", 3);
  check_float(sinks, "sinks", 1);
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), slots = keys.size(1);
  TORCH_CHECK(
      keys.size(0) == rows && keys.size(2) == dim && valid.scalar_type() == at::kBool &&
          valid.is_contiguous() && valid.dim() == 2 && valid.size(0) == rows &&
          valid.size(1) == slots && sinks.size(0) == heads,
      "deepwell_invariant.sink_attention: q [rows, heads, dim], keys [rows, slots, dim] float32, "
      "valid [rows, slots] bool, sinks [heads] expected");
  at::Tensor out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    attend_rows<float>(q, keys, valid, sinks, scale, out);
  } else {
    attend_rows<at::BFloat16>(q, keys, valid, sinks, scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(deepwell_invariant, m) {
  m.def("linear(Tensor x, Tensor w) -> Tensor");
  m.def("index_scores(Tensor queries, Tensor weights, Tensor keys) -> Tensor");
  m.def("sink_attention(Tensor q, Tensor keys, Tensor valid, Tensor sinks, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepwell_invariant, CPU, m) {
  m.impl("linear", &linear);
  m.impl("index_scores", &index_scores);
  m.impl("sink_attention", &sink_attention);
}
