// DeepSeek-V4.1's manifold hyper-connections (mHC, spec/deepseek_v41.md §3.2) per decode row
// in one call each, in place of ~140 small torch ops a sublayer (20 Sinkhorn iterations on a
// 4x4 matrix are 120 of them). Built by layers/decode_kernel.py, registered as torch ops
// (torch.ops.deepwell_mhc.*), called by models/deepseek_v41/mhc.py.
//
//   coefficients  the mixing logits of a row (its mixes, scaled by the row's rsqrt mean
//                 square) → pre [S], post [S], comb [S_in, S_out] (Sinkhorn-normalised);
//   collapse      Σ_s pre[s]·streams[s], in float32 or bfloat16;
//   collapse_norm a sublayer's input: the collapse rounded to the compute dtype, then its
//                 RMSNorm (x · rsqrt(mean(x²) + eps), times the weight), in that dtype;
//   expand        new stream s = post[s]·output + Σ_r comb[r, s]·streams[r].
//
// Each row is computed alone, in float32, in the order mhc.py's torch ops compose it (sums
// over streams in stream order): a row's result does not depend on the rows beside it (batch
// invariant). It differs from the torch ops by float32 rounding only (the order of the mean
// square's sum; exp's last bit), bounded in tests/engine/models/deepseek_v41/test_mhc.py.
// The loops are plain C++: the compiler vectorises the per-channel ones (-O3 -march=native);
// the per-row 4x4 work is a few hundred flops.

#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

// Elements per parallel task: a decode step's few rows stay on the calling thread.
constexpr int64_t kGrainElements = 32768;

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainElements / width); }

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// 1 / sqrt(mean(x²) + eps) over n values: 16 running sums, added pairwise at the end
// (vectorisable, and the same order for any row count).
float inverse_rms(const float* x, int64_t n, float eps) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) lanes[l] += x[i + l] * x[i + l];
  }
  for (; i < n; ++i) lanes[i % 16] += x[i] * x[i];
  for (int half = 8; half > 0; half /= 2) {
    for (int l = 0; l < half; ++l) lanes[l] += lanes[l + half];
  }
  return 1.0f / std::sqrt(lanes[0] / static_cast<float>(n) + eps);
}

void check_float(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(
      t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == dims,
      "deepwell_mhc: ", name, " must be a contiguous float32 tensor of ", dims, " dimensions");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> coefficients(
    const at::Tensor& mixes,
    const at::Tensor& flat,
    const at::Tensor& base,
    const at::Tensor& scale,
    int64_t iterations,
    double eps,
    double norm_eps) {
  check_float(mixes, "mixes", 2);
  check_float(flat, "flat", 2);
  check_float(base, "base", 1);
  check_float(scale, "scale", 1);
  const int64_t rows = mixes.size(0), width = mixes.size(1), channels = flat.size(1);
  const int64_t s = static_cast<int64_t>(std::lround(std::sqrt(width + 1.0) - 1.0));
  TORCH_CHECK(
      s > 0 && s * (s + 2) == width && base.numel() == width && scale.numel() == 3 &&
          flat.size(0) == rows && channels % s == 0,
      "deepwell_mhc.coefficients: mixes [rows, S(S+2)], base [S(S+2)], scale [3], flat "
      "[rows, S*hidden] expected");
  at::Tensor pre = at::empty({rows, s}, mixes.options());
  at::Tensor post = at::empty({rows, s}, mixes.options());
  at::Tensor comb = at::empty({rows, s, s}, mixes.options());
  const float* m = mixes.data_ptr<float>();
  const float* x = flat.data_ptr<float>();
  const float* b = base.data_ptr<float>();
  const float* sc = scale.data_ptr<float>();
  float* pre_out = pre.data_ptr<float>();
  float* post_out = post.data_ptr<float>();
  float* comb_out = comb.data_ptr<float>();
  const float e = static_cast<float>(eps), ne = static_cast<float>(norm_eps);
  at::parallel_for(0, rows, grain_rows(channels), [&](int64_t begin, int64_t end) {
    std::vector<float> logits(width);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * channels;
      const float inv = inverse_rms(row, channels, ne);
      for (int64_t j = 0; j < width; ++j) {
        const float part_scale = j < s ? sc[0] : (j < 2 * s ? sc[1] : sc[2]);
        logits[j] = b[j] + m[r * width + j] * inv * part_scale;
      }
      for (int64_t j = 0; j < s; ++j) {
        pre_out[r * s + j] = sigmoid(logits[j]) + e;
        post_out[r * s + j] = 2.0f * sigmoid(logits[s + j]);
      }
      float* c = comb_out + r * s * s;
      // softmax over each input stream's outputs, plus eps
      for (int64_t i = 0; i < s; ++i) {
        const float* l = logits.data() + 2 * s + i * s;
        float top = l[0];
        for (int64_t o = 1; o < s; ++o) top = std::max(top, l[o]);
        float total = 0.0f;
        for (int64_t o = 0; o < s; ++o) total += (c[i * s + o] = std::exp(l[o] - top));
        for (int64_t o = 0; o < s; ++o) c[i * s + o] = c[i * s + o] / total + e;
      }
      auto normalise_columns = [&] {
        for (int64_t o = 0; o < s; ++o) {
          float total = 0.0f;
          for (int64_t i = 0; i < s; ++i) total += c[i * s + o];
          for (int64_t i = 0; i < s; ++i) c[i * s + o] /= total + e;
        }
      };
      normalise_columns();
      for (int64_t it = 1; it < iterations; ++it) {
        for (int64_t i = 0; i < s; ++i) {
          float total = 0.0f;
          for (int64_t o = 0; o < s; ++o) total += c[i * s + o];
          for (int64_t o = 0; o < s; ++o) c[i * s + o] /= total + e;
        }
        normalise_columns();
      }
    }
  });
  return {pre, post, comb};
}

// One row's S streams summed with their weights `p`, in stream order (the torch ops' order).
inline void weighted_streams(const float* x, const float* p, int64_t s, int64_t hidden,
                             float* sum) {
  for (int64_t h = 0; h < hidden; ++h) sum[h] = p[0] * x[h];
  for (int64_t k = 1; k < s; ++k) {
    const float* stream = x + k * hidden;
    for (int64_t h = 0; h < hidden; ++h) sum[h] += p[k] * stream[h];
  }
}

template <typename O>
void collapse_rows(const float* streams, const float* pre, O* out, int64_t rows, int64_t s,
                   int64_t hidden) {
  at::parallel_for(0, rows, grain_rows(s * hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> sum(hidden);
    for (int64_t r = begin; r < end; ++r) {
      weighted_streams(streams + r * s * hidden, pre + r * s, s, hidden, sum.data());
      O* target = out + r * hidden;
      for (int64_t h = 0; h < hidden; ++h) target[h] = static_cast<O>(sum[h]);
    }
  });
}

at::Tensor collapse(const at::Tensor& streams, const at::Tensor& pre, at::ScalarType dtype) {
  check_float(streams, "streams", 3);
  check_float(pre, "pre", 2);
  const int64_t rows = streams.size(0), s = streams.size(1), hidden = streams.size(2);
  TORCH_CHECK(
      pre.size(0) == rows && pre.size(1) == s,
      "deepwell_mhc.collapse: pre must be [rows, S] for streams [rows, S, hidden]");
  TORCH_CHECK(
      dtype == at::kFloat || dtype == at::kBFloat16,
      "deepwell_mhc.collapse: the output dtype must be float32 or bfloat16");
  at::Tensor out = at::empty({rows, hidden}, streams.options().dtype(dtype));
  if (dtype == at::kFloat) {
    collapse_rows(streams.data_ptr<float>(), pre.data_ptr<float>(), out.data_ptr<float>(), rows,
                  s, hidden);
  } else {
    collapse_rows(streams.data_ptr<float>(), pre.data_ptr<float>(),
                  out.data_ptr<at::BFloat16>(), rows, s, hidden);
  }
  return out;
}

template <typename O>
void collapse_norm_rows(const float* streams, const float* pre, const float* weight, float eps,
                        O* out, int64_t rows, int64_t s, int64_t hidden) {
  at::parallel_for(0, rows, grain_rows(s * hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> sum(hidden);
    for (int64_t r = begin; r < end; ++r) {
      weighted_streams(streams + r * s * hidden, pre + r * s, s, hidden, sum.data());
      // The sublayer's input is the collapse in the compute dtype: normed from those values.
      for (int64_t h = 0; h < hidden; ++h) sum[h] = static_cast<float>(static_cast<O>(sum[h]));
      const float inv = inverse_rms(sum.data(), hidden, eps);
      O* target = out + r * hidden;
      for (int64_t h = 0; h < hidden; ++h) target[h] = static_cast<O>(weight[h] * (sum[h] * inv));
    }
  });
}

at::Tensor collapse_norm(
    const at::Tensor& streams,
    const at::Tensor& pre,
    const at::Tensor& weight,
    double eps,
    at::ScalarType dtype) {
  check_float(streams, "streams", 3);
  check_float(pre, "pre", 2);
  check_float(weight, "weight", 1);
  const int64_t rows = streams.size(0), s = streams.size(1), hidden = streams.size(2);
  TORCH_CHECK(
      pre.size(0) == rows && pre.size(1) == s && weight.numel() == hidden,
      "deepwell_mhc.collapse_norm: pre must be [rows, S] and weight [hidden] for streams "
      "[rows, S, hidden]");
  TORCH_CHECK(
      dtype == at::kFloat || dtype == at::kBFloat16,
      "deepwell_mhc.collapse_norm: the output dtype must be float32 or bfloat16");
  at::Tensor out = at::empty({rows, hidden}, streams.options().dtype(dtype));
  const float e = static_cast<float>(eps);
  if (dtype == at::kFloat) {
    collapse_norm_rows(streams.data_ptr<float>(), pre.data_ptr<float>(), weight.data_ptr<float>(),
                       e, out.data_ptr<float>(), rows, s, hidden);
  } else {
    collapse_norm_rows(streams.data_ptr<float>(), pre.data_ptr<float>(), weight.data_ptr<float>(),
                       e, out.data_ptr<at::BFloat16>(), rows, s, hidden);
  }
  return out;
}

at::Tensor expand(
    const at::Tensor& output,
    const at::Tensor& streams,
    const at::Tensor& post,
    const at::Tensor& comb) {
  check_float(output, "output", 2);
  check_float(streams, "streams", 3);
  check_float(post, "post", 2);
  check_float(comb, "comb", 3);
  const int64_t rows = streams.size(0), s = streams.size(1), hidden = streams.size(2);
  TORCH_CHECK(
      output.size(0) == rows && output.size(1) == hidden && post.size(0) == rows &&
          post.size(1) == s && comb.size(0) == rows && comb.size(1) == s && comb.size(2) == s,
      "deepwell_mhc.expand: output [rows, hidden], post [rows, S], comb [rows, S, S] expected");
  at::Tensor out = at::empty_like(streams);
  const float* y = output.data_ptr<float>();
  const float* x = streams.data_ptr<float>();
  const float* p = post.data_ptr<float>();
  const float* c = comb.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(s * hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row_streams = x + r * s * hidden;
      const float* row_comb = c + r * s * s;
      for (int64_t k = 0; k < s; ++k) {
        float* target = o + (r * s + k) * hidden;
        const float* first = row_streams;
        const float weight0 = row_comb[k];
        for (int64_t h = 0; h < hidden; ++h) target[h] = weight0 * first[h];
        for (int64_t i = 1; i < s; ++i) {
          const float* stream = row_streams + i * hidden;
          const float weight = row_comb[i * s + k];
          for (int64_t h = 0; h < hidden; ++h) target[h] += weight * stream[h];
        }
        const float scale = p[r * s + k];
        const float* out_row = y + r * hidden;
        for (int64_t h = 0; h < hidden; ++h) target[h] = scale * out_row[h] + target[h];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(deepwell_mhc, m) {
  m.def(
      "coefficients(Tensor mixes, Tensor flat, Tensor base, Tensor scale, int iterations, "
      "float eps, float norm_eps) -> (Tensor, Tensor, Tensor)");
  m.def("collapse(Tensor streams, Tensor pre, ScalarType dtype) -> Tensor");
  m.def(
      "collapse_norm(Tensor streams, Tensor pre, Tensor weight, float eps, ScalarType dtype) "
      "-> Tensor");
  m.def("expand(Tensor output, Tensor streams, Tensor post, Tensor comb) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepwell_mhc, CPU, m) {
  m.impl("coefficients", &coefficients);
  m.impl("collapse", &collapse);
  m.impl("collapse_norm", &collapse_norm);
  m.impl("expand", &expand);
}
