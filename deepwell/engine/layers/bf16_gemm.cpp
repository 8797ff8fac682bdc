// bf16 linears of decode-shaped steps (1 to ~64 rows) on AVX512_BF16: x [rows, in] bf16 times
// a weight repacked once at load (layers/bf16_gemm.py, panel_layout) into panels of 32
// outputs, each panel [in / 2][32][2]: the 32 outputs' weights for inputs 2p and 2p + 1 side
// by side, so one 64-byte load is one vdpbf16ps operand. Built by decode_kernel.py, registered
// as torch.ops.deepwell_bf16_gemm.
//
// A decode step streams every weight from memory once and multiplies it into few rows, where
// oneDNN's packed linear ran at ~60 % of the core's bf16 peak on W (docs/benchmarks-log.md,
// "where W's time goes"). Here a panel is multiplied into up to kRowBlock rows at a time in
// registers (2 × rows float32 accumulators, the input pair of each row broadcast once), the
// next panel prefetched into L2 while the first row block reads this one, so every panel is
// read from memory once and from cache for the other row blocks; threads split the panels.
//
// Every output is one float32 accumulator over the input pairs in order from zero, rounded
// once to bf16 after the bias (or kept in float32: the bf16 output head's logits,
// layers/float32_head.py): a row's result depends on that row alone, never on the row count or
// the threads (the same bits in any batch). oneDNN blocks its sums by the CPU's
// caches, so its bits differ from these in the last place for ~1e-4 of the outputs.
//
// Without AVX512_BF16 in the build (an AVX2 build, ATEN_CPU_CAPABILITY=avx2) only
// instruction_set answers ("none"), and the linears keep oneDNN's path.

#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <string>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#define BF16_GEMM_AVX512 1
#include <immintrin.h>
#endif

namespace {

#if defined(BF16_GEMM_AVX512)

// Outputs a panel holds: two 16-lane float32 accumulators a row.
constexpr int64_t kPanel = 32;
// Rows multiplied into one panel at a time: 16 accumulators, and the rows' input (8 × in
// bf16, 24 KiB at in = 1,536) stays in L1 beside the panel's lines.
constexpr int kRowBlock = 8;
// Bytes of one input pair of a panel: two 64-byte lines.
constexpr int64_t kPairBytes = kPanel * 2 * 2;

// float32 → bf16 bits, round to nearest even (vcvtneps2bf16, oneDNN's and torch's rounding
// for finite values).
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// The first `count` of 16 lanes (none for count <= 0, all for count >= 16).
inline __mmask16 lanes(int64_t count) {
  return count >= 16 ? 0xFFFF : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

// out[r][0..valid) = bias + Σ_p x[r] pair p · panel pair p for R rows: rounded to bf16, or
// (Float32Out) stored as the float32 sum. `ahead` is the next panel's bytes, prefetched into L2
// line by line as this one is read.
template <int R, bool Float32Out>
void multiply_panel(
    const int32_t* x,
    int64_t x_row,
    const __m512i* panel,
    int64_t pairs,
    const char* ahead,
    const float* bias,
    void* out,
    int64_t out_row,
    int64_t valid) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    _mm_prefetch(ahead + p * kPairBytes, _MM_HINT_T1);
    _mm_prefetch(ahead + p * kPairBytes + 64, _MM_HINT_T1);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + 2 * p);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + 2 * p + 1);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(x[r * x_row + p]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
    }
  }
  // The outputs of each half that exist: the last panel may hold fewer than 32.
  const __mmask16 masks[2] = {lanes(valid), lanes(valid - 16)};
  for (int r = 0; r < R; ++r) {
    for (int half = 0; half < 2; ++half) {
      const __mmask16 mask = masks[half];
      __m512 v = acc[r][half];
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + 16 * half));
      if constexpr (Float32Out) {
        _mm512_mask_storeu_ps(static_cast<float*>(out) + r * out_row + 16 * half, mask, v);
      } else {
        uint16_t* row = static_cast<uint16_t*>(out) + r * out_row + 16 * half;
        _mm256_mask_storeu_epi16(row, mask, to_bf16(v));
      }
    }
  }
}

template <bool Float32Out>
using PanelFn = void (*)(const int32_t*, int64_t, const __m512i*, int64_t, const char*,
                         const float*, void*, int64_t, int64_t);

template <bool Float32Out, int... R>
constexpr PanelFn<Float32Out> kByRows[] = {multiply_panel<R, Float32Out>...};

// One panel into every row, in as few row blocks as hold them, of sizes differing by one at
// most: 13 rows go as 7 + 6, not 8 + 5, since a block of few rows has too few accumulator
// chains to hide vdpbf16ps's latency.
template <bool Float32Out>
void panel_into_rows(
    const int32_t* x,
    int64_t x_row,
    int64_t rows,
    const __m512i* panel,
    int64_t pairs,
    const char* ahead,
    const float* bias,
    char* out,
    int64_t out_row,
    int64_t element,
    int64_t valid) {
  constexpr PanelFn<Float32Out> const* by_rows = kByRows<Float32Out, 1, 2, 3, 4, 5, 6, 7, 8>;
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t base = rows / blocks, longer = rows % blocks;
  for (int64_t b = 0, r = 0; b < blocks; ++b) {
    const int64_t block = base + (b < longer ? 1 : 0);
    by_rows[block - 1](x + r * x_row, x_row, panel, pairs, ahead, bias,
                       out + r * out_row * element, out_row, valid);
    r += block;
  }
}

#endif  // BF16_GEMM_AVX512

// x [rows, in] bf16 (rows any stride, inputs contiguous, in even); panels bf16
// [ceil(out / 32), in / 2, 32, 2] (panel_layout); bias float32 [out] or none. Returns
// [rows, out]: bf16, or with float32_out the float32 sums (plus the bias) unrounded.
at::Tensor linear(
    const at::Tensor& x,
    const at::Tensor& panels,
    const c10::optional<at::Tensor>& bias,
    int64_t out_features,
    bool float32_out) {
#if defined(BF16_GEMM_AVX512)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "bf16 gemm: x must be bf16 [rows, in] with contiguous inputs, got ", x.sizes());
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(in % 2 == 0 && x.stride(0) % 2 == 0,
              "bf16 gemm: in and x's row stride must be even");
  const int64_t pairs = in / 2, count = (out_features + kPanel - 1) / kPanel;
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() &&
                  panels.dim() == 4 && panels.size(0) == count && panels.size(1) == pairs &&
                  panels.size(2) == kPanel && panels.size(3) == 2,
              "bf16 gemm: panels must be contiguous bf16 [", count, ", ", pairs,
              ", 32, 2], got ", panels.sizes());
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == out_features,
                "bf16 gemm: bias must be contiguous float32 [", out_features, "]");
    bias_data = bias->data_ptr<float>();
  }
  const auto dtype = float32_out ? at::kFloat : at::kBFloat16;
  at::Tensor out = at::empty({rows, out_features}, x.options().dtype(dtype));
  if (rows == 0 || out_features == 0) return out;
  const auto* xs = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>());
  const auto* base = reinterpret_cast<const char*>(panels.data_ptr<at::BFloat16>());
  char* out_base = static_cast<char*>(out.data_ptr());
  const int64_t panel_bytes = pairs * kPairBytes, element = out.element_size();
  const int64_t x_row = x.stride(0) / 2;  // in input pairs
  const auto into_rows = float32_out ? &panel_into_rows<true> : &panel_into_rows<false>;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const char* panel = base + i * panel_bytes;
      // The last panel prefetches itself: a prefetch never faults, but nothing is past it.
      const char* ahead = i + 1 < count ? panel + panel_bytes : panel;
      const float* b = bias_data == nullptr ? nullptr : bias_data + i * kPanel;
      const int64_t valid = std::min<int64_t>(kPanel, out_features - i * kPanel);
      char* o = out_base + i * kPanel * element;
      const auto* w = reinterpret_cast<const __m512i*>(panel);
      into_rows(xs, x_row, rows, w, pairs, ahead, b, o, out_features, element, valid);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "bf16 gemm: this build has no AVX512_BF16 path (instruction_set is none)");
#endif
}

std::string instruction_set() {
#if defined(BF16_GEMM_AVX512)
  return "avx512_bf16";
#else
  return "none";
#endif
}

}  // namespace

TORCH_LIBRARY(deepwell_bf16_gemm, m) {
  m.def(
      "linear(Tensor x, Tensor panels, Tensor? bias, int out_features, bool float32_out) -> "
      "Tensor");
  m.def("instruction_set() -> str", &instruction_set);
}

TORCH_LIBRARY_IMPL(deepwell_bf16_gemm, CPU, m) {
  m.impl("linear", &linear);
}
