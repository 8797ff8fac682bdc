// The sampler's row scans (engine/sampling.py) that torch ops make several whole-vocabulary
// passes of. Built by layers/decode_kernel.py, registered as torch.ops.deepwell_sampling.*.
//
//   first_argmax(logits f32 [rows, vocab]) → i64 [rows]
//       Per row, torch's argmax: the first of its tied maxima, or its first NaN.
//
//   ranked_prefix(scaled f32 [rows, vocab], probs f32 [rows, vocab] or empty,
//                 need_count i64 [rows], need_mass f64 [rows])
//     → (ids i64 [rows, width], count i64 [rows])
//       Per row, the ids of its first tokens in descending order of `scaled`, ties by lower
//       id first (a stable descending sort's order), without sorting the vocabulary: the
//       shortest prefix holding need_count tokens or need_mass of `probs`' mass (float64
//       sums), the whole row when neither is reached. `width` is the longest prefix but at
//       least min(16, vocab); a row's ids past its count repeat its first. A row holding a
//       NaN gets count -1 (its order is the caller's to find).
//
//   top_p_keep(scaled f32 [rows, vocab], probs f32 [rows, vocab], ids i64 [rows, width],
//              count i64 [rows], top_p f32 [rows]) → f32 [rows, vocab]
//       Per row, `scaled` where the token is in the nucleus and -inf elsewhere: of the ranked
//       prefix ids[:count], each token whose probability mass before it is below top_p, in
//       the arithmetic of the torch ops it stands for (engine/sampling.py): the running
//       sums of the float32 probabilities in float64, each rounded to float32 (torch's CPU
//       cumsum), less the token's own in float32, compared in float32. Every prefix token
//       is decided on its own, as there: rounding can make those differences dip.
//
//   top_p_sample(logits f32 [rows, vocab], temperature f32 [rows], top_p f32 [rows],
//                need_mass f64 [rows], min_p f32 [rows], uniforms f64 [rows]) → i64 [rows]
//       Per row, the token engine/sampling.py's torch ops draw for a row sampled with a
//       temperature, top-p and min-p but no top-k, in one pass a row and without their
//       [rows, vocab] intermediates: the division by the temperature; torch's float softmax
//       of the scaled row, through ATen's own vector templates as its kernel calls them
//       (reduce_all of the maximum, exp(x - max), reduce_all of the sum, times 1 / sum), so
//       the probabilities keep their bits; where need_mass is finite (the caller's top_p < 1),
//       ranked_prefix's prefix holding it and top_p_keep's decisions; the kept row's softmax alike (its maximum and
//       exponentials are the row's own, its sum over the kept row with zeros elsewhere);
//       min-p's floor; inverse_cdf's draw. -1 for a row holding a NaN or whose maximum is not
//       finite (the caller's torch path takes it).
//
//   inverse_cdf(probs f32 [rows, vocab], uniforms f64 [rows]) → i64 [rows]
//       Per row, the first token whose float64 cumulative probability exceeds u * total, or
//       the last with mass when none does: torch's float64 cumsum and searchsorted, bit for
//       bit (the cumulative sum is the same sequential float64 sum; adding a zero changes
//       nothing, so the scan skips them).
//
// ranked_prefix bins every token by its distance below the row's maximum (64 bins a nat,
// with each bin's count and mass), walks the bins from the top until the prefix is held,
// and sorts only the tokens of those bins (a stable radix sort of the value's bits). Binning
// is monotone in the logit, so those tokens are the top of the order, ties included.

#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr int kBins = 4096;
constexpr float kBinsPerNat = 64.0f;
// The prefix is padded to this width at least: torch's softmax over a row shorter than a
// vector register sums it otherwise than over a longer one (engine/sampling.py).
constexpr int64_t kMinWidth = 16;

// Larger floats get smaller keys (and -0 the key of +0, as they compare equal), so sorting
// keys ascending, stably, gives the descending order.
uint32_t descending_key(float x) {
  if (x == 0.0f) x = 0.0f;
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return ~ascending;
}

// Monotone (non-increasing) in x: float subtraction and scaling round monotonically. -inf,
// and everything past the last bin, falls in the last bin.
uint16_t bin_of(float x, float top) {
  const float distance = (top - x) * kBinsPerNat;
  if (!(distance < static_cast<float>(kBins - 1))) return kBins - 1;
  return static_cast<uint16_t>(distance);
}

// Stable LSD radix sort of (key, id) pairs by key, a byte at a time; a byte every key shares
// is skipped.
void radix_sort(std::vector<uint32_t>& keys, std::vector<int32_t>& ids) {
  const size_t n = keys.size();
  std::vector<uint32_t> keys_out(n);
  std::vector<int32_t> ids_out(n);
  for (int shift = 0; shift < 32; shift += 8) {
    std::array<size_t, 257> starts{};
    for (const uint32_t key : keys) ++starts[((key >> shift) & 0xFF) + 1];
    if (std::any_of(starts.begin() + 1, starts.end(), [n](size_t c) { return c == n; })) continue;
    for (int b = 0; b < 256; ++b) starts[b + 1] += starts[b];
    for (size_t i = 0; i < n; ++i) {
      const size_t to = starts[(keys[i] >> shift) & 0xFF]++;
      keys_out[to] = keys[i];
      ids_out[to] = ids[i];
    }
    keys.swap(keys_out);
    ids.swap(ids_out);
  }
}

// One prefix token's top-p decision in the torch ops' arithmetic (engine/sampling.py):
// `running` holds the float64 sum of the probabilities before it, rounded to float32 as
// torch's CPU cumsum rounds its float64 sums; the token stays while the mass before it,
// that sum with its own probability p and less p in float32, is below top_p (a NaN stays).
inline bool in_nucleus(double& running, float p, float top_p) {
  running += p;
  const float before = static_cast<float>(running) - p;
  return !(before >= top_p);
}

// fn(row, scratch) for rows [0, rows), the rows dealt to the threads in turn, not in runs
// (a row's cost follows the length of its prefix, which varies from row to row: 64 rows in
// two runs left one thread idle a tenth of the time), each thread with its own Scratch.
template <typename Scratch, typename Fn>
void rows_in_turn(int64_t rows, const Fn& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), rows);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t thread = begin; thread < end; ++thread) {
      for (int64_t row = thread; row < rows; row += threads) fn(row, scratch);
    }
  });
}

// A thread's buffers, reused row after row.
struct PrefixScratch {
  std::vector<uint16_t> bins;
  std::vector<int32_t> ids;
  std::vector<uint32_t> keys;
};

// A row's maximum, or NaN if it holds one, vectorised (a scalar compare a token was a third
// of ranked_prefix's time).
float row_top(const float* scaled, int64_t vocab) {
  float top = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
  for (int64_t j = 0; j < vocab; ++j) {
    const float x = scaled[j];
    nan |= x != x;
    top = x > top ? x : top;
  }
  return nan ? NAN : top;
}

// The ranked prefix of a row without a NaN whose maximum is `top`; token j's probability is
// values[j] * scale (the probabilities and 1, or the exponentials and 1 / their sum: the
// same float32 product the probabilities were made of), none without `values`.
std::vector<int64_t> row_prefix(
    const float* scaled, const float* values, float scale, int64_t vocab, float top,
    int64_t need_count, double need_mass, PrefixScratch& scratch) {
  std::vector<uint16_t>& bins = scratch.bins;
  bins.resize(vocab);
#pragma omp simd
  for (int64_t j = 0; j < vocab; ++j) bins[j] = bin_of(scaled[j], top);
  std::vector<int32_t> counts(kBins, 0);
  std::vector<float> masses(kBins, 0.0f);
  if (values != nullptr) {
    for (int64_t j = 0; j < vocab; ++j) {
      ++counts[bins[j]];
      masses[bins[j]] += values[j] * scale;
    }
  } else {
    for (int64_t j = 0; j < vocab; ++j) ++counts[bins[j]];
  }
  // The bins' masses are float32 sums, a little off; the float64 walk below decides.
  int last_bin = kBins - 1;
  int64_t held = 0;
  double mass = 0.0;
  for (int bin = 0; bin < kBins; ++bin) {
    held += counts[bin];
    mass += masses[bin];
    if (held >= need_count || mass >= need_mass) {
      last_bin = bin;
      break;
    }
  }
  // The tokens of those bins, in vocabulary order, without a branch a token: every id is
  // written and the end moves past it only if it is taken.
  std::vector<int32_t>& ids = scratch.ids;
  ids.resize(vocab);
  int64_t taken = 0;
  for (int64_t j = 0; j < vocab; ++j) {
    ids[taken] = static_cast<int32_t>(j);
    taken += bins[j] <= last_bin;
  }
  ids.resize(taken);
  std::vector<uint32_t>& keys = scratch.keys;
  keys.resize(taken);
  for (int64_t i = 0; i < taken; ++i) keys[i] = descending_key(scaled[ids[i]]);
  radix_sort(keys, ids);
  double prefix_mass = 0.0;
  size_t count = ids.size();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (values != nullptr) prefix_mass += values[ids[i]] * scale;
    if (static_cast<int64_t>(i + 1) >= need_count || prefix_mass >= need_mass) {
      count = i + 1;
      break;
    }
  }
  return std::vector<int64_t>(ids.begin(), ids.begin() + count);
}

std::tuple<at::Tensor, at::Tensor> ranked_prefix(
    const at::Tensor& scaled, const at::Tensor& probs, const at::Tensor& need_count,
    const at::Tensor& need_mass) {
  TORCH_CHECK(
      scaled.dim() == 2 && scaled.scalar_type() == at::kFloat,
      "deepwell_sampling.ranked_prefix: scaled logits are float32 [rows, vocab]; got ",
      scaled.scalar_type(), " of ", scaled.dim(), " dimensions");
  const int64_t rows = scaled.size(0);
  const int64_t vocab = scaled.size(1);
  const bool with_mass = probs.numel() > 0;
  TORCH_CHECK(
      !with_mass || (probs.sizes() == scaled.sizes() && probs.scalar_type() == at::kFloat),
      "deepwell_sampling.ranked_prefix: probs are float32 of the logits' shape or empty");
  TORCH_CHECK(
      need_count.numel() == rows && need_count.scalar_type() == at::kLong &&
          need_mass.numel() == rows && need_mass.scalar_type() == at::kDouble,
      "deepwell_sampling.ranked_prefix: need_count is int64 and need_mass float64, one a row");
  const at::Tensor logits = scaled.contiguous();
  const at::Tensor mass = with_mass ? probs.contiguous() : probs;
  const at::Tensor counts_in = need_count.contiguous();
  const at::Tensor masses_in = need_mass.contiguous();
  const int64_t* count_of = counts_in.data_ptr<int64_t>();
  const double* mass_of = masses_in.data_ptr<double>();

  std::vector<std::vector<int64_t>> prefixes(rows);
  rows_in_turn<PrefixScratch>(rows, [&](int64_t row, PrefixScratch& scratch) {
    const float* scaled_row = logits.data_ptr<float>() + row * vocab;
    const float top = row_top(scaled_row, vocab);
    if (std::isnan(top)) return;  // an empty prefix: count -1 below
    prefixes[row] = row_prefix(
        scaled_row, with_mass ? mass.data_ptr<float>() + row * vocab : nullptr, 1.0f, vocab, top,
        count_of[row], mass_of[row], scratch);
  });

  int64_t width = std::min(kMinWidth, vocab);
  for (const auto& prefix : prefixes) width = std::max<int64_t>(width, prefix.size());
  at::Tensor ids = at::empty({rows, width}, scaled.options().dtype(at::kLong));
  at::Tensor count = at::empty({rows}, scaled.options().dtype(at::kLong));
  int64_t* ids_out = ids.data_ptr<int64_t>();
  int64_t* count_out = count.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    const auto& prefix = prefixes[row];
    int64_t* out = ids_out + row * width;
    if (prefix.empty()) {
      count_out[row] = -1;
      std::fill(out, out + width, 0);
      continue;
    }
    count_out[row] = static_cast<int64_t>(prefix.size());
    std::copy(prefix.begin(), prefix.end(), out);
    std::fill(out + prefix.size(), out + width, prefix.front());
  }
  return {ids, count};
}

// Pass two's blocks: a block-wide vector compare says whether the block holds the answer,
// then a scalar walk finds it there.
constexpr int64_t kArgmaxBlock = 64;

// A row's first maximum (torch's argmax; its first NaN if it has one) in two passes over a
// row that stays in L2 (196 KB at most for 49,152 float32 logits): the maximum and whether
// there is a NaN, then the first element equal to it (-0 equals +0, as in torch). `omp simd`
// reductions let the compiler vectorise both at any instruction-set level.
int64_t row_first_argmax(const float* row, int64_t vocab) {
  float top = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
  for (int64_t j = 0; j < vocab; ++j) {
    const float x = row[j];
    nan |= x != x;
    top = x > top ? x : top;
  }
  if (nan) {
    for (int64_t j = 0; j < vocab; ++j) {
      if (std::isnan(row[j])) return j;
    }
  }
  for (int64_t block = 0; block < vocab; block += kArgmaxBlock) {
    const int64_t end = std::min(block + kArgmaxBlock, vocab);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t j = block; j < end; ++j) hit |= row[j] == top;
    if (!hit) continue;
    for (int64_t j = block; j < end; ++j) {
      if (row[j] == top) return j;
    }
  }
  return 0;  // not reached: the maximum is some element's
}

void rows_first_argmax(const at::Tensor& logits, int64_t* out) {
  const int64_t vocab = logits.size(1);
  const int64_t stride = logits.stride(0);
  const float* data = logits.data_ptr<float>();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      out[row] = row_first_argmax(data + row * stride, vocab);
    }
  });
}

at::Tensor first_argmax(const at::Tensor& logits) {
  TORCH_CHECK(
      logits.dim() == 2 && logits.size(1) > 0 && logits.scalar_type() == at::kFloat,
      "deepwell_sampling.first_argmax: logits are float32 [rows, vocab > 0]");
  const at::Tensor rows = logits.stride(1) == 1 ? logits : logits.contiguous();
  at::Tensor tokens = at::empty({rows.size(0)}, rows.options().dtype(at::kLong));
  rows_first_argmax(rows, tokens.data_ptr<int64_t>());
  return tokens;
}

at::Tensor top_p_keep(
    const at::Tensor& scaled, const at::Tensor& probs, const at::Tensor& ids,
    const at::Tensor& count, const at::Tensor& top_p) {
  TORCH_CHECK(
      scaled.dim() == 2 && scaled.scalar_type() == at::kFloat && probs.sizes() == scaled.sizes() &&
          probs.scalar_type() == at::kFloat,
      "deepwell_sampling.top_p_keep: scaled logits and probs are float32 [rows, vocab]");
  const int64_t rows = scaled.size(0), vocab = scaled.size(1);
  TORCH_CHECK(
      ids.dim() == 2 && ids.size(0) == rows && ids.scalar_type() == at::kLong &&
          count.numel() == rows && count.scalar_type() == at::kLong && top_p.numel() == rows &&
          top_p.scalar_type() == at::kFloat,
      "deepwell_sampling.top_p_keep: ids int64 [rows, width], count int64 and top_p float32 [rows]");
  const at::Tensor logits = scaled.contiguous(), mass = probs.contiguous(), ranked = ids.contiguous();
  const at::Tensor counts = count.contiguous(), limits = top_p.contiguous();
  const int64_t width = ranked.size(1);
  const int64_t* id_of = ranked.data_ptr<int64_t>();
  const int64_t* count_of = counts.data_ptr<int64_t>();
  const float* limit_of = limits.data_ptr<float>();
  for (int64_t row = 0; row < rows; ++row) {
    TORCH_CHECK(count_of[row] >= 1 && count_of[row] <= width,
                "deepwell_sampling.top_p_keep: a row's count is 1 to the prefix width");
    const int64_t* prefix = id_of + row * width;
    TORCH_CHECK(std::all_of(prefix, prefix + count_of[row], [vocab](int64_t id) { return id >= 0 && id < vocab; }),
                "deepwell_sampling.top_p_keep: an id outside the vocabulary");
  }
  at::Tensor kept = at::empty({rows, vocab}, logits.options());
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* x = logits.data_ptr<float>() + row * vocab;
      const float* p = mass.data_ptr<float>() + row * vocab;
      const int64_t* prefix = id_of + row * width;
      float* out = kept.data_ptr<float>() + row * vocab;
      std::fill(out, out + vocab, -INFINITY);
      double running = 0.0;
      for (int64_t i = 0; i < count_of[row]; ++i) {
        const int64_t id = prefix[i];
        if (in_nucleus(running, p[id], limit_of[row])) out[id] = x[id];
      }
    }
  });
  return kept;
}

// inverse_cdf's draw from one row of probabilities: the first token whose float64
// cumulative probability exceeds u * total (the total over the row, in id order), or the
// last with mass when none does. `with_mass` is scratch of the row's length.
int64_t draw_from_row(const float* probs, int64_t vocab, double u, std::vector<int32_t>& with_mass) {
  with_mass.resize(vocab);
  // The tokens with mass, in id order, without a branch a token (a nucleus leaves them
  // scattered: a branch on each mispredicted often); the scans below read only them.
  int64_t held = 0, next = 0;
#if defined(__AVX512F__)
  // 16 at a time, their ids compressed out (a NaN counts as mass, as != 0 says).
  __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; next + 16 <= vocab; next += 16) {
    const __mmask16 nonzero = _mm512_cmp_ps_mask(_mm512_loadu_ps(probs + next), _mm512_setzero_ps(), _CMP_NEQ_UQ);
    _mm512_mask_compressstoreu_epi32(with_mass.data() + held, nonzero, ids);
    held += __builtin_popcount(nonzero);
    ids = _mm512_add_epi32(ids, _mm512_set1_epi32(16));
  }
#endif
  for (; next < vocab; ++next) {
    with_mass[held] = static_cast<int32_t>(next);
    held += probs[next] != 0.0f;
  }
  double total = 0.0;
  for (int64_t i = 0; i < held; ++i) total += static_cast<double>(probs[with_mass[i]]);
  int64_t token = vocab - 1;  // no mass at all: torch's search gives the last token
  for (int64_t i = held - 1; i >= 0; --i) {
    if (probs[with_mass[i]] > 0.0f) {
      token = with_mass[i];
      break;
    }
  }
  const double target = u * total;
  double cumulative = 0.0;
  for (int64_t i = 0; i < held; ++i) {
    const int64_t j = with_mass[i];
    cumulative += static_cast<double>(probs[j]);
    if (cumulative > target) return j;
  }
  return token;
}

using Vec = at::vec::Vectorized<float>;

// ATen's reductions of a row as its softmax kernel makes them (the maximum propagates a NaN).
float vector_max(const float* x, int64_t n) {
  return at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, n);
}

float vector_sum(const float* x, int64_t n) {
  return at::vec::reduce_all<float>([](Vec a, Vec b) { return a + b; }, x, n);
}

// The first steps of torch's float softmax of `x` (ATen's _vec_softmax_lastdim): the
// maximum and the exponentials exp(x - max) into `exps`; returns the maximum and 1 / the
// exponentials' sum, by which the kernel's last step multiplies them.
std::pair<float, float> softmax_exps(const float* x, int64_t vocab, float* exps) {
  const float top = vector_max(x, vocab);
  at::vec::map([top](Vec a) { return (a - Vec(top)).exp(); }, exps, x, vocab);
  return {top, 1 / vector_sum(exps, vocab)};
}

void scale_row(const float* values, float scale, int64_t vocab, float* out) {
  at::vec::map([scale](Vec a) { return a * Vec(scale); }, out, values, vocab);
}

// A thread's rows of the scaled logits, their exponentials and probabilities, reused.
struct SampleScratch {
  std::vector<float> scaled, exps, probs, kept_exps;
  std::vector<int32_t> with_mass;
  PrefixScratch prefix;
};

int64_t top_p_sample_row(const float* logits, int64_t vocab, float temperature, float top_p,
                         double need_mass, float min_p, double u, SampleScratch& s) {
  s.scaled.resize(vocab);
  s.exps.resize(vocab);
  s.probs.resize(vocab);
  float* scaled = s.scaled.data();
  at::vec::map([temperature](Vec a) { return a / Vec(temperature); }, scaled, logits, vocab);
  // ATen's maximum propagates a NaN: the maximum is finite unless the row holds one, every
  // token is masked, or a logit is infinite.
  const auto [top, inverse_sum] = softmax_exps(scaled, vocab, s.exps.data());
  if (!std::isfinite(top)) return -1;
  const float* exps = s.exps.data();
  float* probs = s.probs.data();
  if (std::isfinite(need_mass)) {
    // The nucleus, as ranked_prefix and top_p_keep decide it, each probability the softmax's
    // product exps[j] * inverse_sum made where it is read; then the kept row's softmax: its
    // maximum is the row's (the first token always stays), so its exponentials are the
    // row's where kept and exp(-inf) = 0 elsewhere, summed over the whole row as torch sums.
    const std::vector<int64_t> prefix =
        row_prefix(scaled, exps, inverse_sum, vocab, top, vocab, need_mass, s.prefix);
    s.kept_exps.assign(vocab, 0.0f);
    double running = 0.0;
    for (const int64_t id : prefix) {
      if (in_nucleus(running, exps[id] * inverse_sum, top_p)) s.kept_exps[id] = exps[id];
    }
    scale_row(s.kept_exps.data(), 1 / vector_sum(s.kept_exps.data(), vocab), vocab, probs);
  } else {
    scale_row(exps, inverse_sum, vocab, probs);
  }
  if (min_p > 0.0f) {
    const float floor = min_p * vector_max(probs, vocab);
    for (int64_t j = 0; j < vocab; ++j) probs[j] = probs[j] < floor ? 0.0f : probs[j];
  }
  return draw_from_row(probs, vocab, u, s.with_mass);
}

at::Tensor top_p_sample(
    const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_p,
    const at::Tensor& need_mass, const at::Tensor& min_p, const at::Tensor& uniforms) {
  TORCH_CHECK(
      logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
      "deepwell_sampling.top_p_sample: logits are float32 [rows, vocab > 0]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  for (const auto* t : {&temperature, &top_p, &min_p}) {
    TORCH_CHECK(t->numel() == rows && t->scalar_type() == at::kFloat,
                "deepwell_sampling.top_p_sample: temperature, top_p and min_p are float32, one a row");
  }
  for (const auto* t : {&need_mass, &uniforms}) {
    TORCH_CHECK(t->numel() == rows && t->scalar_type() == at::kDouble,
                "deepwell_sampling.top_p_sample: need_mass and uniforms are float64, one a row");
  }
  const at::Tensor x = logits.contiguous(), temperatures = temperature.contiguous();
  const at::Tensor limits = top_p.contiguous(), masses = need_mass.contiguous();
  const at::Tensor floors = min_p.contiguous(), u = uniforms.contiguous();
  at::Tensor tokens = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  rows_in_turn<SampleScratch>(rows, [&](int64_t row, SampleScratch& scratch) {
    out[row] = top_p_sample_row(
        x.data_ptr<float>() + row * vocab, vocab, temperatures.data_ptr<float>()[row],
        limits.data_ptr<float>()[row], masses.data_ptr<double>()[row],
        floors.data_ptr<float>()[row], u.data_ptr<double>()[row], scratch);
  });
  return tokens;
}

at::Tensor inverse_cdf(const at::Tensor& probs, const at::Tensor& uniforms) {
  TORCH_CHECK(
      probs.dim() == 2 && probs.scalar_type() == at::kFloat && uniforms.numel() == probs.size(0) &&
          uniforms.scalar_type() == at::kDouble,
      "deepwell_sampling.inverse_cdf: probs are float32 [rows, vocab], uniforms float64, one a "
      "row");
  const int64_t rows = probs.size(0);
  const int64_t vocab = probs.size(1);
  const at::Tensor p = probs.contiguous();
  const at::Tensor u = uniforms.contiguous();
  at::Tensor tokens = at::empty({rows}, probs.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> with_mass;
    for (int64_t row = begin; row < end; ++row) {
      out[row] = draw_from_row(p.data_ptr<float>() + row * vocab, vocab, u.data_ptr<double>()[row], with_mass);
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY(deepwell_sampling, m) {
  m.def(
      "ranked_prefix(Tensor scaled, Tensor probs, Tensor need_count, Tensor need_mass) -> "
      "(Tensor, Tensor)");
  m.def(
      "top_p_keep(Tensor scaled, Tensor probs, Tensor ids, Tensor count, Tensor top_p) -> Tensor");
  m.def(
      "top_p_sample(Tensor logits, Tensor temperature, Tensor top_p, Tensor need_mass, "
      "Tensor min_p, Tensor uniforms) -> Tensor");
  m.def("inverse_cdf(Tensor probs, Tensor uniforms) -> Tensor");
  m.def("first_argmax(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepwell_sampling, CPU, m) {
  m.impl("ranked_prefix", &ranked_prefix);
  m.impl("top_p_keep", &top_p_keep);
  m.impl("top_p_sample", &top_p_sample);
  m.impl("inverse_cdf", &inverse_cdf);
  m.impl("first_argmax", &first_argmax);
}
