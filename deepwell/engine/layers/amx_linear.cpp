// bf16 linears on AMX tiles: every bf16 linear's where oneDNN would use the tiles
// (layers/packed_linear.py), the batch-invariant mode's, and the bf16 output head's float32
// logits (layers/float32_head.py): x [rows, in] bf16 times a weight packed once at load
// (layers/amx_linear.py, tile_layout) into 16 × 32 tiles in the VNNI layout, plus a bias,
// rounded once to bf16 [rows, out] or kept as the float32 sums. Built by decode_kernel.py
// (only where the CPU and torch's level have AMX), registered as torch.ops.deepwell_amx_linear.
//
// Why the bits are a row's own: a tile product (tdpbf16ps) computes each row of its 16 × 16
// float32 result from that row of its input tile only, and every output here is one result
// element accumulated from zero over the input's 32-wide blocks in order, one tile product a
// block. The blocking of the input never changes, the rows are zero-padded to whole 16-row
// tiles (a tile product costs the same for 1 row as for 16), and threads split the outputs,
// never the input: so a row's result is the same whatever the row count and the rows beside
// it. oneDNN's AMX path blocks its sums by the row count (36 against 37 rows differ); the
// vector kernel this replaces in the batch-invariant mode (blockscaled.cpp's bf16_linear)
// took 3x this for SmolLM2's linears at 16 rows (docs/benchmarks-log.md, "Batch invariance
// on AMX tiles").
//
// The tile state is asked of Linux before the first tile instruction (kernel_parts.h's
// amx_tiles_permitted).

#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512VL__) && defined(__linux__)
#define AMX_LINEAR 1
#include <immintrin.h>
#endif

#include "kernel_parts.h"

namespace {

#if defined(AMX_LINEAR)

// A tile: 16 rows of 64 bytes (32 bf16 inputs of a row; 16 input pairs × 16 outputs of the
// weight; 16 float32 outputs of a row).
constexpr int64_t kTileRows = 16;
constexpr int64_t kBlockInputs = 32;
constexpr int64_t kTileOutputs = 16;
// Row tiles whose inputs a pass over the weights multiplies: 128 rows, 384 KiB of input at
// in = 1,536, in a 2 MiB L2 beside the weights streaming past (even, so pairs stay pairs).
constexpr int64_t kChunkTiles = 8;
// bf16 elements of one packed weight tile.
constexpr int64_t kWeightTile = kBlockInputs * kTileOutputs;

using StoreFn = void (*)(const float*, const float*, int64_t, void*);

// The previous block of results, stored a few rows at a time while the AMX unit computes the
// next block's tile products: the vector unit's rounding and stores then overlap the tile
// work, where storing a block before starting the next left the tiles idle for it. A
// 1,024-row gate_up (576 -> 3,072) went from 1.97 to 1.47 ms in a C probe of this loop,
// 1.41 without any stores.
struct PendingRows {
  const float* sums = nullptr;  // [rows][scratch_row]
  int64_t rows = 0, next = 0, scratch_row = 0, valid_out = 0;
  const float* bias = nullptr;
  char* dest = nullptr;  // the first row's first output
  int64_t dest_row_bytes = 0;
  StoreFn store = nullptr;

  void emit(int64_t count) {
    for (const int64_t end = std::min(rows, next + count); next < end; ++next)
      store(sums + next * scratch_row, bias, valid_out, dest + next * dest_row_bytes);
  }
  void finish() { emit(rows); }
};

// RowTiles × 16 rows of x (the first row tile's at x0, the second's at x1, row stride
// x_bytes) times OutTiles × 16 outputs of the packed weight (w: the first output tile's block
// 0; the next output tile is w_tile_step elements on), over `blocks` input blocks in order;
// results into scratch [RowTiles × 16][OutTiles × 16], which `pending` must not hold. Its
// rows are stored meanwhile, spread over the blocks.
// tmm0-3 hold the results (2 row tiles × 2 output tiles), tmm4-5 the inputs, tmm6-7 weights.
template <int RowTiles, int OutTiles>
void multiply_tiles(
    const uint16_t* x0,
    const uint16_t* x1,
    int64_t x_bytes,
    const uint16_t* w,
    int64_t w_tile_step,
    int64_t blocks,
    float* scratch,
    PendingRows& pending) {
  _tile_zero(0);
  if constexpr (OutTiles > 1) _tile_zero(1);
  if constexpr (RowTiles > 1) _tile_zero(2);
  if constexpr (RowTiles > 1 && OutTiles > 1) _tile_zero(3);
  const int64_t rows_a_block = (pending.rows - pending.next + blocks - 1) / blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    _tile_loadd(4, x0 + b * kBlockInputs, x_bytes);
    if constexpr (RowTiles > 1) _tile_loadd(5, x1 + b * kBlockInputs, x_bytes);
    _tile_loadd(6, w + b * kWeightTile, 64);
    if constexpr (OutTiles > 1) _tile_loadd(7, w + w_tile_step + b * kWeightTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (OutTiles > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RowTiles > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RowTiles > 1 && OutTiles > 1) _tile_dpbf16ps(3, 5, 7);
    pending.emit(rows_a_block);
  }
  pending.finish();
  constexpr int64_t stride = OutTiles * kTileOutputs * sizeof(float);
  _tile_stored(0, scratch, stride);
  if constexpr (OutTiles > 1) _tile_stored(1, scratch + kTileOutputs, stride);
  if constexpr (RowTiles > 1) _tile_stored(2, scratch + kTileRows * OutTiles * kTileOutputs, stride);
  if constexpr (RowTiles > 1 && OutTiles > 1)
    _tile_stored(3, scratch + kTileRows * OutTiles * kTileOutputs + kTileOutputs, stride);
}

using MultiplyFn = void (*)(const uint16_t*, const uint16_t*, int64_t, const uint16_t*, int64_t,
                            int64_t, float*, PendingRows&);
constexpr MultiplyFn kMultiply[2][2] = {
    {multiply_tiles<1, 1>, multiply_tiles<1, 2>},
    {multiply_tiles<2, 1>, multiply_tiles<2, 2>},
};

// x zero-padded to whole 16-row tiles and 32-input blocks, unless it already is.
// The first `count` of 16 lanes (none for count <= 0, all for count >= 16).
inline __mmask16 lanes(int64_t count) {
  return count >= 16 ? 0xFFFF : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

// out[0..valid) = sums + bias: as float32 (Float32Out), or rounded to bf16, to nearest even
// (torch's `.to(torch.bfloat16)` of the float32 sum plus the bias, as RowwiseLinear rounds).
// Stream: whole aligned vectors bypass the caches (non-temporal stores), for outputs far past
// them (below, kStreamBytes).
template <bool Float32Out, bool Stream = false>
void store_row(const float* sums, const float* bias, int64_t valid, void* out) {
  for (int64_t o = 0; o < valid; o += 16) {
    const __mmask16 mask = lanes(valid - o);
    __m512 v = _mm512_maskz_loadu_ps(mask, sums + o);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + o));
    if constexpr (Float32Out) {
      float* target = static_cast<float*>(out) + o;
      if (Stream && mask == 0xFFFF && reinterpret_cast<uintptr_t>(target) % 64 == 0) {
        _mm512_stream_ps(target, v);
      } else {
        _mm512_mask_storeu_ps(target, mask, v);
      }
    } else {
      uint16_t* target = static_cast<uint16_t*>(out) + o;
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(v);
      if (Stream && mask == 0xFFFF && reinterpret_cast<uintptr_t>(target) % 32 == 0) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(target), rounded);
      } else {
        _mm256_mask_storeu_epi16(target, mask, rounded);
      }
    }
  }
}

// An output of at least this many bytes is stored past the caches: a 1,024-row prompt chunk's
// gate_up (6.3 MB), the bf16 head's logits of a many-row decode step (10.8 MB for 55 rows of
// SmolLM2's 49,152). They would only evict the weights and be read back from memory anyway; a
// normal store reads each line in before writing it, and those reads, between the next
// block's tile loads (PendingRows), held the loads up: that gate_up took 2.8 ms stored
// normally, 1.64 streamed, 2.1-2.3 before the stores overlapped the tiles. The head of a
// 56-row W step: 2.9 against 3.5 ms.
constexpr int64_t kStreamBytes = 4 << 20;

// x's rows as tiles read it: in place where x is contiguous and `in` whole 32-input blocks,
// but for its last partial row tile, which comes from a zero-padded copy of its rows; else all
// of x from such a copy. Copying the whole input to pad its last rows took a fifth of the
// product's time at 1,035 rows and 55 (two threads), where 1,040 and 64 take none. The tail
// is a plain buffer: at::zeros filled it in a parallel region of its own, every call.
struct TileInput {
  at::Tensor whole;
  deepwell::TileVector<uint16_t> tail;
  // Row tiles read from `whole`; the one after them, if any, is `tail`.
  int64_t whole_tiles = 0;
  int64_t row_elements = 0;
  const uint16_t* whole_data = nullptr;
  const uint16_t* tail_data = nullptr;

  TileInput(const at::Tensor& x, int64_t padded_in) : row_elements(padded_in) {
    const int64_t rows = x.size(0), in = x.size(1);
    const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
    if (in == padded_in && x.is_contiguous()) {
      whole = x;
      whole_tiles = rows / kTileRows;
      const int64_t tail_rows = rows - whole_tiles * kTileRows;
      if (tail_rows > 0) {
        tail.resize(kTileRows * padded_in);
        const auto* first = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
        std::memcpy(tail.data(), first + whole_tiles * kTileRows * padded_in,
                    tail_rows * padded_in * sizeof(uint16_t));
        tail_data = tail.data();
      }
    } else {
      whole = at::zeros({row_tiles * kTileRows, padded_in}, x.options());
      whole.narrow(0, 0, rows).narrow(1, 0, in).copy_(x);
      whole_tiles = row_tiles;
    }
    whole_data = reinterpret_cast<const uint16_t*>(whole.data_ptr<at::BFloat16>());
  }

  const uint16_t* row_tile(int64_t index) const {
    return index < whole_tiles ? whole_data + index * kTileRows * row_elements : tail_data;
  }
};

// silu(gate) * up for one row of a gate_up whose output tile pairs are (gate tile j, up tile
// j) (gate_up_tile_layout): sums [0, 16) the gate's, [16, 32) the up's. Each rounded to bf16
// first, as the linear stores them, then llama_glue.cpp's silu_mul on those: its arithmetic
// (silu_times) and its rounding, so the bits are the two passes' bits.
template <bool Stream>
void store_silu_row(const float* sums, const float*, int64_t, void* out) {
  using Vec = at::vec::Vectorized<float>;
  const auto widened = [](const float* v) {
    const __m256i bits = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(v));
    return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
  };
  const Vec act = deepwell::silu_times(widened(sums), widened(sums + kTileOutputs));
  const __m512i rounded = at::vec::convert_from_float<at::BFloat16>(act, act);
  const __m256i first = _mm512_castsi512_si256(rounded);
  if (Stream && reinterpret_cast<uintptr_t>(out) % 32 == 0) {
    _mm256_stream_si256(static_cast<__m256i*>(out), first);
  } else {
    _mm256_storeu_si256(static_cast<__m256i*>(out), first);
  }
}

// x [rows, in] bf16 times the tiles into `out`: each output the linear's (the sums plus the
// bias, bf16 or float32 as out is), or with `silu` a gate_up's silu(gate) * up, one output of
// `out` (bf16 [rows, out_tiles × 8]) for each pair of gate and up outputs.
void multiply(const at::Tensor& x, const at::Tensor& tiles, const float* bias_data,
              int64_t out_features, bool silu, at::Tensor& out) {
  const int64_t rows = x.size(0);
  const int64_t blocks = tiles.size(1);
  const int64_t out_tiles = tiles.size(0);
  const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
  const TileInput input(x, blocks * kBlockInputs);
  const auto* ws = reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>());
  char* result = static_cast<char*>(out.data_ptr());
  const int64_t element = out.element_size(), out_row_bytes = out.size(1) * element;
  const bool float32_out = out.scalar_type() == at::kFloat;
  const bool stream = out.numel() * element >= kStreamBytes;
  const StoreFn store =
      silu          ? (stream ? &store_silu_row<true> : &store_silu_row<false>)
      : float32_out ? (stream ? &store_row<true, true> : &store_row<true>)
                    : (stream ? &store_row<false, true> : &store_row<false>);
  const int64_t x_bytes = blocks * kBlockInputs * 2, w_tile_step = blocks * kWeightTile;
  const int64_t out_pairs = (out_tiles + 1) / 2;
  // Threads take pairs of output tiles; rows go kChunkTiles row tiles at a time, whose inputs
  // stay in L2 while every pair's weights stream past them once.
  at::parallel_for(0, out_pairs, 1, [&](int64_t begin, int64_t end) {
    deepwell::load_full_tile_config();
    // Two blocks of results: one being stored while the next is computed into the other.
    alignas(64) float scratch[2][2 * kTileRows][2 * kTileOutputs];
    int current = 0;
    PendingRows pending;
    pending.store = store;
    pending.dest_row_bytes = out_row_bytes;
    for (int64_t chunk = 0; chunk < row_tiles; chunk += kChunkTiles) {
      const int64_t chunk_end = std::min(row_tiles, chunk + kChunkTiles);
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t first_out = 2 * pair * kTileOutputs;
        const int out_count = 2 * pair + 1 < out_tiles ? 2 : 1;
        const uint16_t* w = ws + 2 * pair * w_tile_step;
        for (int64_t row_tile = chunk; row_tile < chunk_end; row_tile += 2) {
          const int row_count = row_tile + 1 < chunk_end ? 2 : 1;
          const int64_t first_row = row_tile * kTileRows;
          const uint16_t* x0 = input.row_tile(row_tile);
          const uint16_t* x1 = row_count > 1 ? input.row_tile(row_tile + 1) : x0;
          float* sums = &scratch[current][0][0];
          kMultiply[row_count - 1][out_count - 1](x0, x1, x_bytes, w, w_tile_step, blocks, sums,
                                                  pending);
          pending.sums = sums;
          pending.rows = std::min(row_count * kTileRows, rows - first_row);
          pending.next = 0;
          pending.scratch_row = out_count * kTileOutputs;
          pending.valid_out = std::min(out_count * kTileOutputs, out_features - first_out);
          pending.bias = bias_data == nullptr ? nullptr : bias_data + first_out;
          pending.dest = result + first_row * out_row_bytes +
                         (silu ? pair * kTileOutputs : first_out) * element;
          current ^= 1;
        }
      }
    }
    pending.finish();
    _tile_release();
    // Non-temporal stores are weakly ordered: drain them before the caller reads the output.
    if (stream) _mm_sfence();
  });
}

// x bf16 [rows, in] against tiles bf16 [out_tiles, ceil(in / 32), 16, 16, 2].
void check_operands(const at::Tensor& x, const at::Tensor& tiles, int64_t out_tiles) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "amx linear: x must be bf16 [rows, in], got ", x.sizes());
  const int64_t blocks = (x.size(1) + kBlockInputs - 1) / kBlockInputs;
  TORCH_CHECK(tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous() &&
                  tiles.dim() == 5 && tiles.size(0) == out_tiles && tiles.size(1) == blocks &&
                  tiles.size(2) == kBlockInputs / 2 && tiles.size(3) == kTileOutputs &&
                  tiles.size(4) == 2,
              "amx linear: tiles must be contiguous bf16 [", out_tiles, ", ", blocks,
              ", 16, 16, 2], got ", tiles.sizes());
  TORCH_CHECK(deepwell::amx_tiles_permitted(), "amx linear: the kernel refused the AMX tile state");
}

#endif  // AMX_LINEAR

// x [rows, in] bf16; tiles bf16 [ceil(out / 16), ceil(in / 32), 16, 16, 2] (tile_layout).
// bias float32 [out] or none. Returns [rows, out] = x @ weight.T + bias: bf16, or with
// float32_out the float32 sums (plus the bias) unrounded.
at::Tensor linear(
    const at::Tensor& x,
    const at::Tensor& tiles,
    const c10::optional<at::Tensor>& bias,
    int64_t out_features,
    bool float32_out) {
#if defined(AMX_LINEAR)
  check_operands(x, tiles, (out_features + kTileOutputs - 1) / kTileOutputs);
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == out_features,
                "amx linear: bias must be contiguous float32 [", out_features, "]");
    bias_data = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({x.size(0), out_features},
                             x.options().dtype(float32_out ? at::kFloat : at::kBFloat16));
  if (out.numel() > 0) multiply(x, tiles, bias_data, out_features, false, out);
  return out;
#else
  TORCH_CHECK(false, "amx linear: this build has no AMX path (instruction_set is none)");
#endif
}

// silu(gate) * up, bf16 [rows, intermediate], of a gate_up linear without bias whose weight
// [gate; up] (2 × intermediate outputs) is packed as gate_up_tile_layout: the bits of
// `linear` on its tile_layout followed by llama_glue.cpp's silu_mul, in one pass.
at::Tensor silu_mul_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t intermediate) {
#if defined(AMX_LINEAR)
  TORCH_CHECK(intermediate % kTileOutputs == 0,
              "amx silu_mul_linear: the intermediate size must be a multiple of 16, got ",
              intermediate);
  check_operands(x, tiles, 2 * intermediate / kTileOutputs);
  at::Tensor out = at::empty({x.size(0), intermediate}, x.options());
  if (out.numel() > 0) multiply(x, tiles, nullptr, 2 * intermediate, true, out);
  return out;
#else
  TORCH_CHECK(false, "amx linear: this build has no AMX path (instruction_set is none)");
#endif
}

std::string instruction_set() {
#if defined(AMX_LINEAR)
  return deepwell::amx_tiles_permitted() ? "amx_bf16" : "none";
#else
  return "none";
#endif
}

}  // namespace

TORCH_LIBRARY(deepwell_amx_linear, m) {
  m.def(
      "linear(Tensor x, Tensor tiles, Tensor? bias, int out_features, bool float32_out) -> "
      "Tensor");
  m.def("silu_mul_linear(Tensor x, Tensor tiles, int intermediate) -> Tensor");
  m.def("instruction_set() -> str", &instruction_set);
}

TORCH_LIBRARY_IMPL(deepwell_amx_linear, CPU, m) {
  m.impl("linear", &linear);
  m.impl("silu_mul_linear", &silu_mul_linear);
}
