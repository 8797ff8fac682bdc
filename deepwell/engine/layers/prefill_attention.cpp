// Causal attention of one prefill chunk over its sequence's paged KV cache, flash-style:
// online softmax over packed key blocks, bf16 dot products (AVX512_BF16); built on first use
// by layers/decode_kernel.py and registered as torch.ops.deepwell_prefill.
//
// A chunk of `length` query rows ends the sequence's `context_len` keys (the cached prefix,
// then the chunk's own keys, already stored): row i sees keys 0 .. context_len - length + i.
// Each KV head's keys and values are first packed in the cache order dpbf16 reads (pairs of
// head dims for the scores, pairs of keys for the values), then tasks of (KV head, block of
// query positions) take each GQA group's query heads together, block of keys by block of
// keys, skipping the blocks past their last position. Scores, softmax and the output
// accumulate in float32; the softmax weights are rounded to bf16 for the value product, as
// torch's CPU flash kernel rounds them. The bf16 products run as VDPBF16PS or, where that
// instruction is slow, as FMAs on the widened halves that round to the same bits (`Products`),
// the blocks widened once a call. What the causal mask zeroes is skipped where the bits allow:
// key vectors past every row of a tile in the scores and the softmax, and in the FMA form the
// value products of a block's last 32 keys (`masked_tail`). Where AMX tiles run, both products
// run on them instead (`attend_on_tiles`), with bits of their own.

#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define DEEPWELL_PREFILL_BF16 1
#include <immintrin.h>
#endif
// The AMX form (`attend_on_tiles`): built where decode_kernel.py passes the tile flags.
#if defined(DEEPWELL_PREFILL_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__linux__)
#define DEEPWELL_PREFILL_AMX 1
#endif

#include "kernel_parts.h"

namespace {

#if defined(DEEPWELL_PREFILL_BF16)

// Keys per packed block: one register tile's four vectors of 16 scores.
constexpr int64_t kKeys = 64;
// Query positions per task: with a group of 3 heads, 96 rows share each key block's reads.
constexpr int64_t kPositions = 32;
// Query rows per register tile: 6 x 4 accumulators, 4 key vectors and a broadcast fit the
// 32 vector registers.
constexpr int kTileRows = 6;
// Head dims per value tile: four vectors of 16 float32 accumulators a row.
constexpr int64_t kDimChunk = 64;

// 2^x, for x <= 0 (masked lanes are zeroed by the caller): x = n + f with |f| <= 1/2,
// 2^f by its Taylor series to degree `Degree`, scaled by 2^n exactly. Degree 7 (the vector
// forms): relative error under 1e-8; 5 (the AMX form, whose weights round to bf16's 2^-9
// and whose sums the tile products round anyway): under 3e-6.
template <int Degree = 7>
inline __m512 exp2_ps(__m512 x) {
  // (ln 2)^k / k!, k = 7 .. 0.
  constexpr float kTaylor[8] = {1.525273380405984e-05f, 1.5403530393381606e-04f,
                                1.3333558146428443e-03f, 9.618129107628477e-03f,
                                5.550410866482158e-02f,  2.402265069591007e-01f,
                                6.931471805599453e-01f,  1.f};
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kTaylor[7 - Degree]);
  for (int k = 8 - Degree; k < 8; ++k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kTaylor[k]));
  return _mm512_scalef_ps(p, n);
}

inline __m512bh as_bf16(__m512i v) {
  return reinterpret_cast<__m512bh&>(v);
}

// How the bf16 products are formed; both give the same bits. VDPBF16PS adds a lane's odd
// product, then its even one, each sum rounded to nearest even with denormal inputs and
// results flushed to zero, whatever MXCSR says. A bf16 x bf16 product is exact in float32, so
// two FMAs on the widened halves, odd then even, under DAZ and FTZ round the same sums alike
// (checked bit for bit on 12.6M lanes with exponents across float32's whole range, denormals
// and overflows included). On the AMX Xeon (Sapphire Rapids) VDPBF16PS issues one every two
// cycles and FMA two a cycle: 16 against 32 products a cycle, less the widening.
// Its AMX tiles (TDPBF16PS) cannot give these bits in any packing: a tile product sums its
// even products in order from zero and its odd ones apart, each sum rounded, then adds the
// two to the accumulator last. One product an output a tile product, the only packing in
// this order, still rounds an overflowing product to infinity and flushes a denormal one
// before the sum, at half the FMAs' rate (benchmarks/amx_tile_rounding.py;
// docs/benchmarks-log.md, "AMX tile products do not round as VDPBF16PS").
enum class Products { kDotBf16, kFma };

#if defined(__AMX_BF16__)
constexpr Products kNativeProducts = Products::kFma;
#else
// AVX512_BF16 without AMX (AMD Zen 4): not measured there; VDPBF16PS widens for free.
constexpr Products kNativeProducts = Products::kDotBf16;
#endif

// A packed block's element: a bf16 pair for VDPBF16PS; for the FMAs each pair's halves
// widened to two floats ahead (`widen_rows`), so that their loops issue nothing but FMAs and
// loads: once a block for every query row, where widening in the loop cost 4 ops beside 24 FMAs
// on the same two ports.
template <Products P>
using Packed = std::conditional_t<P == Products::kFma, float, uint32_t>;
template <Products P>
constexpr int64_t kPackedPerPair = P == Products::kFma ? 2 : 1;

// VDPBF16PS's fixed modes for the FMA form (round to nearest even, DAZ, FTZ, no exception
// raised: all masked) while it lives; the caller's MXCSR after, flags included, so the
// softmax between the products keeps the caller's modes and the products leave no flags, as
// VDPBF16PS leaves none. The FMA tiles are not inlined and MXCSR moves in volatile asm that
// clobbers memory: the compiler cannot carry a product out of the span, nor a softmax
// operation into it.
class DotBf16Modes {
 public:
  DotBf16Modes() {
    asm volatile("stmxcsr %0" : "=m"(saved_) : : "memory");
    const unsigned modes = (saved_ & ~kRounding) | kDazFtz | kAllMasked;
    asm volatile("ldmxcsr %0" : : "m"(modes) : "memory");
  }
  ~DotBf16Modes() { asm volatile("ldmxcsr %0" : : "m"(saved_) : "memory"); }
  DotBf16Modes(const DotBf16Modes&) = delete;
  DotBf16Modes& operator=(const DotBf16Modes&) = delete;

 private:
  static constexpr unsigned kRounding = 0x6000, kDazFtz = 0x8040, kAllMasked = 0x1F80;
  unsigned saved_;
};

// The high bf16 of each 32-bit lane (the odd one of a pair) as a float, and the low one.
inline __m512 odd_halves(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(-65536)));
}
inline __m512 even_halves(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}

// s[R][kKeys] = the R query rows (bf16, head dims in pairs) times one packed key block
// ([pairs][kKeys] pairs of bf16 head dims).
template <int R>
inline void score_tile(const int32_t* const* q, const uint32_t* keys, int64_t pairs, float* s) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t* row = keys + p * kKeys;
    __m512bh k[4];
    for (int v = 0; v < 4; ++v) k[v] = as_bf16(_mm512_loadu_si512(row + 16 * v));
    for (int r = 0; r < R; ++r) {
      const __m512bh pair = as_bf16(_mm512_set1_epi32(q[r][p]));
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pair, k[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(s + r * kKeys + 16 * v, acc[r][v]);
  }
}

// acc[r][v] += a_odd[r * stride] × odd[16v .. 16v + 15], then + a_even[r * stride] ×
// even[16v .. 16v + 15]: 32 bf16 pair products of VDPBF16PS's, as two FMAs each in its order
// (see Products), for R rows at once, on pairs widened ahead (`widen_rows`) so that the loop
// issues nothing but FMAs beside its loads.
template <int R>
inline void fma_pairs(const float* odd, const float* even, const float* a_odd,
                      const float* a_even, int64_t stride, __m512 (&acc)[R][2]) {
  const __m512 o[2] = {_mm512_loadu_ps(odd), _mm512_loadu_ps(odd + 16)};
  const __m512 e[2] = {_mm512_loadu_ps(even), _mm512_loadu_ps(even + 16)};
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    const __m512 a_o = _mm512_set1_ps(a_odd[r * stride]);
    const __m512 a_e = _mm512_set1_ps(a_even[r * stride]);
    for (int v = 0; v < 2; ++v) {
      acc[r][v] = _mm512_fmadd_ps(a_e, e[v], _mm512_fmadd_ps(a_o, o[v], acc[r][v]));
    }
  }
}

// score_tile as FMAs on a widened key block ([pairs][2][kKeys] floats: each pair's odd
// dims, then its even ones), the R rows' head dims widened too, [R][pairs] floats of each
// pair's odd dim and of its even one. Half a block's keys at a time: 2R accumulators, two key
// vectors' halves and the rows' query broadcasts fit the 32 registers, where a whole block
// spilled the accumulators to the stack. `halves`: 1 where the rows see none of the block's
// last 32 keys (their scores are not read).
template <int R>
__attribute__((noinline)) void score_tile_fma(
    const float* q_odd, const float* q_even, const float* keys, int64_t pairs, int halves,
    float* s) {
  for (int half = 0; half < halves; ++half) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const float* odd = keys + 2 * p * kKeys + 32 * half;
      fma_pairs<R>(odd, odd + kKeys, q_odd + p, q_even + p, pairs, acc);
    }
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 2; ++v) {
        _mm512_storeu_ps(s + r * kKeys + 32 * half + 16 * v, acc[r][v]);
      }
    }
  }
}

// o[R][dim] = o * alpha (per row) + the R rows of weights (bf16 [R][kKeys]) times one packed
// value block ([kKeys / 2][dim] pairs of bf16 keys).
template <int R>
inline void value_tile(
    const uint16_t* weights,
    const uint32_t* values,
    int64_t dim,
    const float* alpha,
    float* o) {
  const int32_t* w = reinterpret_cast<const int32_t*>(weights);
  for (int64_t c = 0; c < dim; c += kDimChunk) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int v = 0; v < 4; ++v) {
        acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + r * dim + c + 16 * v), a);
      }
    }
    for (int64_t m = 0; m < kKeys / 2; ++m) {
      const uint32_t* row = values + m * dim + c;
      __m512bh vv[4];
      for (int v = 0; v < 4; ++v) vv[v] = as_bf16(_mm512_loadu_si512(row + 16 * v));
      for (int r = 0; r < R; ++r) {
        const __m512bh pair = as_bf16(_mm512_set1_epi32(w[r * (kKeys / 2) + m]));
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pair, vv[v]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 4; ++v) _mm512_storeu_ps(o + r * dim + c + 16 * v, acc[r][v]);
    }
  }
}

// value_tile as FMAs on a widened value block ([kKeys / 2][2][dim] floats: each key pair's
// odd key, then its even one), on rows of o already rescaled (outside DotBf16Modes, as
// value_tile rescales them): the R rows' weights widened, [R][kKeys / 2] floats of each key
// pair's odd key and of its even one. 32 head dims at a time, for the registers as in
// score_tile_fma. With `tail` (`masked_tail`), the block's last kKeys / 2 keys, which no row
// sees, are left out and their effect on a -0 sum put in its place.
template <int R>
__attribute__((noinline)) void value_tile_fma(
    const float* w_odd, const float* w_even, const float* values, int64_t dim,
    const float* tail, float* o) {
  const int64_t key_pairs = tail ? kKeys / 4 : kKeys / 2;
  const __m512i negative_zero = _mm512_set1_epi32(std::numeric_limits<int32_t>::min());
  for (int64_t c = 0; c < dim; c += 32) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 2; ++v) acc[r][v] = _mm512_loadu_ps(o + r * dim + c + 16 * v);
    }
    for (int64_t m = 0; m < key_pairs; ++m) {
      const float* odd = values + 2 * m * dim + c;
      fma_pairs<R>(odd, odd + dim, w_odd + m, w_even + m, kKeys / 2, acc);
    }
    if (tail) {
      for (int r = 0; r < R; ++r) {
        for (int v = 0; v < 2; ++v) {
          const __mmask16 zero = _mm512_cmpeq_epi32_mask(
              _mm512_castps_si512(acc[r][v]), negative_zero);
          acc[r][v] = _mm512_mask_loadu_ps(acc[r][v], zero, tail + c + 16 * v);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 2; ++v) _mm512_storeu_ps(o + r * dim + c + 16 * v, acc[r][v]);
    }
  }
}

// Lanes of vector v (keys 16v .. 16v + 15 of a block) at or below `last`, the row's last
// visible key in the block (negative: none).
inline __mmask16 visible_lanes(int64_t last, int v) {
  const int64_t below = last - 16 * v + 1;
  if (below >= 16) return 0xFFFF;
  if (below <= 0) return 0;
  return static_cast<__mmask16>((1u << below) - 1);
}

struct Chunk {
  const uint16_t* q;
  int64_t q_row;
  uint16_t* out;
  int64_t out_row;
  const uint16_t* key_cache;
  const uint16_t* value_cache;
  const int64_t* table;
  int64_t length;
  int64_t context_len;
  int64_t heads;
  int64_t kv_heads;
  int64_t block_size;
  int64_t dim;
  float scale;
};

// Key (or value) `key` of KV head h in a paged cache, or null past the context.
const uint16_t* cache_row(const Chunk& c, const uint16_t* cache, int64_t h, int64_t key) {
  if (key >= c.context_len) return nullptr;
  const int64_t block = c.table[key / c.block_size];
  return cache + ((block * c.kv_heads + h) * c.block_size + key % c.block_size) * c.dim;
}

// Packs key block b of KV head h: keys [pairs][kKeys] as (dim 2p, dim 2p + 1) pairs, values
// [kKeys / 2][dim] as (key 2m, key 2m + 1) pairs; keys past the context are zeros.
void pack_block(const Chunk& c, int64_t h, int64_t b, uint32_t* keys, uint32_t* values) {
  const int64_t pairs = c.dim / 2;
  for (int64_t j = 0; j < kKeys; ++j) {
    const auto* k =
        reinterpret_cast<const uint32_t*>(cache_row(c, c.key_cache, h, b * kKeys + j));
    for (int64_t p = 0; p < pairs; ++p) keys[p * kKeys + j] = k ? k[p] : 0u;
  }
  for (int64_t m = 0; m < kKeys / 2; ++m) {
    const uint16_t* even = cache_row(c, c.value_cache, h, b * kKeys + 2 * m);
    const uint16_t* odd = cache_row(c, c.value_cache, h, b * kKeys + 2 * m + 1);
    uint32_t* dst = values + m * c.dim;
    for (int64_t d = 0; d < c.dim; ++d) {
      const uint32_t lo = even ? even[d] : 0u;
      const uint32_t hi = odd ? odd[d] : 0u;
      dst[d] = lo | (hi << 16);
    }
  }
}

// The FMA form's packed block: each row of `width` bf16 pairs as `width` floats of their odd
// halves, then `width` of their even ones.
void widen_rows(const uint32_t* pairs, int64_t rows, int64_t width, float* wide) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < width; i += 16) {
      const __m512i v = _mm512_loadu_si512(pairs + r * width + i);
      _mm512_storeu_ps(wide + 2 * r * width + i, odd_halves(v));
      _mm512_storeu_ps(wide + (2 * r + 1) * width + i, even_halves(v));
    }
  }
}

// The FMA form's masked tail of a value block, its last kKeys / 2 keys: where a tile's rows
// see none of them, their products all weigh +0 and are left out. Each would add +0 × value,
// which leaves a sum as it is but a -0 one, turned +0 by a value whose sign is clear (a
// denormal counts as its signed zero, DAZ), and turns any sum NaN where the value is not
// finite. `zeros[d]`: what a -0 sum in dim d ends at, -0 where every value there has its sign
// set, else +0. False where a value is not finite: that block's tail is then computed.
bool masked_tail(const uint32_t* value_pairs, int64_t dim, float* zeros) {
  const __m512i exponents = _mm512_set1_epi16(0x7F80);
  const __m512i signs = _mm512_set1_epi32(static_cast<int32_t>(0x80008000u));
  for (int64_t d = 0; d < dim; d += 16) {
    __m512i all_negative = _mm512_set1_epi32(-1);
    for (int64_t m = kKeys / 4; m < kKeys / 2; ++m) {
      const __m512i pairs = _mm512_loadu_si512(value_pairs + m * dim + d);
      if (_mm512_cmpeq_epi16_mask(_mm512_and_si512(pairs, exponents), exponents)) return false;
      all_negative = _mm512_and_si512(all_negative, pairs);
    }
    const __mmask16 negative =
        _mm512_cmpeq_epi32_mask(_mm512_and_si512(all_negative, signs), signs);
    _mm512_storeu_ps(
        zeros + d, _mm512_mask_blend_ps(negative, _mm512_set1_ps(0.f), _mm512_set1_ps(-0.f)));
  }
  return true;
}

// Per-thread working memory of a task: its rows' output, running max and sum, one tile's
// scores and weights; for the FMA form its queries and weights widened to float halves.
struct Scratch {
  std::vector<float> out, max, sum, scores, alpha;
  std::vector<uint16_t> weights;
  std::vector<const int32_t*> q;
  std::vector<float> q_odd, q_even, weights_odd, weights_even;
};

// o[R][dim] *= alpha per row, as value_tile scales its accumulators; rows scaled by 1 are left
// as they are (o holds no denormals: the FMAs flush their results, so x * 1 is x).
template <int R>
inline void rescale_rows(float* o, int64_t dim, const float* alpha) {
  for (int r = 0; r < R; ++r) {
    if (alpha[r] == 1.f) continue;
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int64_t d = 0; d < dim; d += 16) {
      _mm512_storeu_ps(o + r * dim + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * dim + d), a));
    }
  }
}

template <Products P, int R>
void tile_step(
    const Chunk& c,
    Scratch& w,
    int64_t first_row,
    int64_t group,
    int64_t first_position,
    int64_t block,
    const Packed<P>* keys,
    const Packed<P>* values,
    const float* tail) {
  // Scores in base 2: softmax(s * scale) = 2^(s * scale * log2(e) - max) / sum.
  const __m512 scale = _mm512_set1_ps(c.scale * 1.4426950408889634f);
  const int64_t pairs = c.dim / 2;
  float* s = w.scores.data();
  // The tile's last key in the block: its last row sees furthest.
  const int64_t tile_last = first_position + (first_row + R - 1) / group - block * kKeys;
  if constexpr (P == Products::kFma) {
    const DotBf16Modes modes;
    score_tile_fma<R>(
        w.q_odd.data() + first_row * pairs, w.q_even.data() + first_row * pairs, keys, pairs,
        tile_last < kKeys / 2 ? 1 : 2, s);
  } else {
    score_tile<R>(w.q.data() + first_row, keys, pairs, s);
  }
  for (int r = 0; r < R; ++r) {
    const int64_t row = first_row + r;
    const int64_t last = first_position + row / group - block * kKeys;
    // Key vectors wholly past the row's last key weigh +0 whatever their scores: neither
    // read nor exponentiated (a +0 added to the sum leaves it).
    const int seen = last < 0 ? 0 : static_cast<int>(std::min<int64_t>(last / 16 + 1, 4));
    __m512 t[4];
    __mmask16 lanes[4];
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int v = 0; v < seen; ++v) {
      lanes[v] = visible_lanes(last, v);
      t[v] = _mm512_mul_ps(_mm512_loadu_ps(s + r * kKeys + 16 * v), scale);
      top = _mm512_mask_max_ps(top, lanes[v], top, t[v]);
    }
    const float old_max = w.max[row];
    const float new_max = std::max(old_max, _mm512_reduce_max_ps(top));
    // The first block (key 0, seen by every row) leaves every row a finite max. A block that
    // does not raise it scales by exp2(0) = 1: no call (the common case past a few blocks).
    const float alpha =
        new_max == old_max && std::isfinite(old_max) ? 1.f : std::exp2(old_max - new_max);
    const __m512 shift = _mm512_set1_ps(new_max);
    __m512 total = _mm512_setzero_ps();
    __m512 p[4];
    for (int v = 0; v < 4; ++v) {
      if (v < seen) {
        p[v] = _mm512_maskz_mov_ps(lanes[v], exp2_ps(_mm512_sub_ps(t[v], shift)));
        total = _mm512_add_ps(total, p[v]);
      } else {
        p[v] = _mm512_setzero_ps();
      }
    }
    const auto first = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p[1], p[0]));
    const auto second = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p[3], p[2]));
    if constexpr (P == Products::kFma) {
      float* odd = w.weights_odd.data() + r * (kKeys / 2);
      float* even = w.weights_even.data() + r * (kKeys / 2);
      _mm512_storeu_ps(odd, odd_halves(first));
      _mm512_storeu_ps(odd + 16, odd_halves(second));
      _mm512_storeu_ps(even, even_halves(first));
      _mm512_storeu_ps(even + 16, even_halves(second));
    } else {
      _mm512_storeu_si512(w.weights.data() + r * kKeys, first);
      _mm512_storeu_si512(w.weights.data() + r * kKeys + 32, second);
    }
    w.sum[row] = w.sum[row] * alpha + _mm512_reduce_add_ps(total);
    w.max[row] = new_max;
    w.alpha[r] = alpha;
  }
  float* o = w.out.data() + first_row * c.dim;
  if constexpr (P == Products::kFma) {
    rescale_rows<R>(o, c.dim, w.alpha.data());
    const DotBf16Modes modes;
    value_tile_fma<R>(w.weights_odd.data(), w.weights_even.data(), values, c.dim,
                      tile_last < kKeys / 2 ? tail : nullptr, o);
  } else {
    value_tile<R>(w.weights.data(), values, c.dim, w.alpha.data(), o);
  }
}

template <Products P>
using TileStep = void (*)(
    const Chunk&, Scratch&, int64_t, int64_t, int64_t, int64_t, const Packed<P>*,
    const Packed<P>*, const float*);
template <Products P>
constexpr TileStep<P> kTileSteps[kTileRows + 1] = {
    nullptr,
    tile_step<P, 1>,
    tile_step<P, 2>,
    tile_step<P, 3>,
    tile_step<P, 4>,
    tile_step<P, 5>,
    tile_step<P, 6>};

// The FMA form's queries: each row's head dims as the odd and the even halves of its pairs.
void widen_queries(const Scratch& w, int64_t rows, int64_t pairs, float* odd, float* even) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t p = 0; p < pairs; p += 16) {
      const __m512i q = _mm512_loadu_si512(w.q[r] + p);
      _mm512_storeu_ps(odd + r * pairs + p, odd_halves(q));
      _mm512_storeu_ps(even + r * pairs + p, even_halves(q));
    }
  }
}

// One task: KV head h, query positions [begin, end) of the chunk, every query head of the
// group, over the key blocks up to the last position.
template <Products P>
void run_task(
    const Chunk& c,
    Scratch& w,
    int64_t h,
    int64_t begin,
    int64_t end,
    const Packed<P>* packed_keys,
    const Packed<P>* packed_values,
    const float* const* tails,
    int64_t key_blocks) {
  const int64_t group = c.heads / c.kv_heads;
  const int64_t rows = (end - begin) * group;
  const int64_t offset = c.context_len - c.length;  // position of row 0 of the chunk
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = begin + r / group, head = h * group + r % group;
    w.q[r] = reinterpret_cast<const int32_t*>(c.q + i * c.q_row + head * c.dim);
  }
  if constexpr (P == Products::kFma) {
    widen_queries(w, rows, c.dim / 2, w.q_odd.data(), w.q_even.data());
  }
  std::fill(w.out.begin(), w.out.begin() + rows * c.dim, 0.f);
  std::fill(w.max.begin(), w.max.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(w.sum.begin(), w.sum.begin() + rows, 0.f);
  const int64_t key_block_size = (c.dim / 2) * kKeys * kPackedPerPair<P>;
  const int64_t value_block_size = (kKeys / 2) * c.dim * kPackedPerPair<P>;
  const int64_t last_block = (offset + end - 1) / kKeys;
  for (int64_t b = 0; b <= last_block; ++b) {
    const Packed<P>* keys = packed_keys + (h * key_blocks + b) * key_block_size;
    const Packed<P>* values = packed_values + (h * key_blocks + b) * value_block_size;
    const float* tail = tails[h * key_blocks + b];
    for (int64_t r = 0; r < rows; r += kTileRows) {
      const int n = static_cast<int>(std::min<int64_t>(kTileRows, rows - r));
      // Every key of a block past a tile's last position is masked for all its rows.
      const int64_t last_position = offset + begin + (r + n - 1) / group;
      if (b * kKeys > last_position) continue;
      kTileSteps<P>[n](c, w, r, group, offset + begin, b, keys, values, tail);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = begin + r / group, head = h * group + r % group;
    const float inverse = 1.f / w.sum[r];
    const float* src = w.out.data() + r * c.dim;
    uint16_t* dst = c.out + i * c.out_row + head * c.dim;
    for (int64_t d = 0; d < c.dim; d += 32) {
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(src + d), _mm512_set1_ps(inverse));
      const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(src + d + 16), _mm512_set1_ps(inverse));
      _mm512_storeu_si512(dst + d, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
}

template <Products P>
void attend(const Chunk& c) {
  const int64_t key_blocks = (c.context_len + kKeys - 1) / kKeys;
  const int64_t pairs = c.dim / 2;
  const int64_t key_block_size = pairs * kKeys * kPackedPerPair<P>;
  const int64_t value_block_size = (kKeys / 2) * c.dim * kPackedPerPair<P>;
  // Left unzeroed (new[] of a trivial type): the packing writes every element.
  const std::unique_ptr<Packed<P>[]> keys(new Packed<P>[c.kv_heads * key_blocks * key_block_size]);
  const std::unique_ptr<Packed<P>[]> values(
      new Packed<P>[c.kv_heads * key_blocks * value_block_size]);
  // The FMA form's masked tails (`masked_tail`), by block: null where not skippable.
  const std::unique_ptr<float[]> tail_zeros(
      new float[P == Products::kFma ? c.kv_heads * key_blocks * c.dim : 0]);
  std::vector<const float*> tails(c.kv_heads * key_blocks, nullptr);
  at::parallel_for(0, c.kv_heads * key_blocks, 8, [&](int64_t first, int64_t last) {
    std::vector<uint32_t> key_pairs, value_pairs;
    if constexpr (P == Products::kFma) {
      key_pairs.resize(pairs * kKeys);
      value_pairs.resize((kKeys / 2) * c.dim);
    }
    for (int64_t t = first; t < last; ++t) {
      const int64_t h = t / key_blocks, b = t % key_blocks;
      if constexpr (P == Products::kFma) {
        pack_block(c, h, b, key_pairs.data(), value_pairs.data());
        widen_rows(key_pairs.data(), pairs, kKeys, keys.get() + t * key_block_size);
        widen_rows(value_pairs.data(), kKeys / 2, c.dim, values.get() + t * value_block_size);
        float* zeros = tail_zeros.get() + t * c.dim;
        if (masked_tail(value_pairs.data(), c.dim, zeros)) tails[t] = zeros;
      } else {
        pack_block(
            c,
            h,
            b,
            keys.get() + t * key_block_size,
            values.get() + t * value_block_size);
      }
    }
  });
  // Later query blocks see more keys: handed out latest first, from one shared counter, so
  // the threads finish together.
  const int64_t query_blocks = (c.length + kPositions - 1) / kPositions;
  const int64_t tasks = c.kv_heads * query_blocks;
  const int64_t group = c.heads / c.kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch w;
    const int64_t rows = kPositions * group;
    w.out.resize(rows * c.dim);
    w.max.resize(rows);
    w.sum.resize(rows);
    w.q.resize(rows);
    w.scores.resize(kTileRows * kKeys);
    w.weights.resize(kTileRows * kKeys);
    w.alpha.resize(kTileRows);
    if constexpr (P == Products::kFma) {
      w.q_odd.resize(rows * c.dim / 2);
      w.q_even.resize(rows * c.dim / 2);
      w.weights_odd.resize(kTileRows * kKeys / 2);
      w.weights_even.resize(kTileRows * kKeys / 2);
    }
    for (int64_t t = next++; t < tasks; t = next++) {
      const int64_t qb = query_blocks - 1 - t / c.kv_heads, h = t % c.kv_heads;
      const int64_t begin = qb * kPositions;
      run_task<P>(
          c,
          w,
          h,
          begin,
          std::min(c.length, begin + kPositions),
          keys.get(),
          values.get(),
          tails.data(),
          key_blocks);
    }
  });
}

#if defined(DEEPWELL_PREFILL_AMX)

// The AMX form: the scores and the value products as tile products (TDPBF16PS), the softmax
// between them on vectors. A tile product rounds its sums its own way (see Products), so this
// form's bits are not the other two's; its outputs are as close to exact attention as theirs
// (the tests hold every form to the same bound).
//
// It computes the transposes, keys × query rows, so that a vector holds one key's scores of
// 16 query rows: the softmax's max, sum and rescale are then lane-wise, with no reduction
// across a vector and nothing per row. A task's rows go 16 at a time (a row tile), each over
// spans of kSpanKeys keys:
//   scores^T [16 keys × 16 rows] = keys [16 × 32 head dims] · queries^T (pairs of dims × rows),
//   outputs^T [16 dims × 16 rows] += values^T [16 dims × 32 keys] · weights^T (key pairs × rows).
// Every tile is 16 rows of 64 bytes; tmm0-3 accumulate, tmm4-5 hold keys or values (one
// loading while the other multiplies), tmm6 the queries or the weights.
constexpr int64_t kTile = 16;
// bf16 elements of a tile.
constexpr int64_t kTileBf16 = 2 * kTile * kTile;
// Keys of one value product: a values^T tile's row.
constexpr int64_t kValueStep = 32;
// Keys per softmax span: a row tile's scores and weights of a span (16 and 8 KiB) stay in L1
// from the score products through the softmax to the value products, and the output is
// rescaled at most once a span.
constexpr int64_t kSpanKeys = 256;
// Accumulator tiles a pass: key tiles of scores, or dim tiles of outputs.
constexpr int64_t kAccumulators = 4;

// tmm0 .. tmm(N-1) += N tiles at a (the next `a_step` elements on, rows a_bytes apart) times
// tmm6.
template <int N>
inline void add_products(const uint16_t* a, int64_t a_bytes, int64_t a_step) {
  _tile_loadd(4, a, a_bytes);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (N > 1) {
    _tile_loadd(5, a + a_step, a_bytes);
    _tile_dpbf16ps(1, 5, 6);
  }
  if constexpr (N > 2) {
    _tile_loadd(4, a + 2 * a_step, a_bytes);
    _tile_dpbf16ps(2, 4, 6);
  }
  if constexpr (N > 3) {
    _tile_loadd(5, a + 3 * a_step, a_bytes);
    _tile_dpbf16ps(3, 5, 6);
  }
}

// N accumulators from (Load) or to float32 tiles at c, `step` floats apart, rows 64 bytes.
template <int N, bool Load>
inline void move_tiles(float* c, int64_t step) {
  if constexpr (Load) {
    _tile_loadd(0, c, 64);
    if constexpr (N > 1) _tile_loadd(1, c + step, 64);
    if constexpr (N > 2) _tile_loadd(2, c + 2 * step, 64);
    if constexpr (N > 3) _tile_loadd(3, c + 3 * step, 64);
  } else {
    _tile_stored(0, c, 64);
    if constexpr (N > 1) _tile_stored(1, c + step, 64);
    if constexpr (N > 2) _tile_stored(2, c + 2 * step, 64);
    if constexpr (N > 3) _tile_stored(3, c + 3 * step, 64);
  }
}

// scores^T of N key tiles (keys: the first one's first row, rows dim apart, the next tile
// 16 rows on) against a row tile's queries^T (dim / 32 tiles from queries), stored key by
// key at s (16 floats a key).
template <int N>
void score_tiles(const uint16_t* keys, int64_t dim, const uint32_t* queries, float* s) {
  _tile_zero(0);
  if constexpr (N > 1) _tile_zero(1);
  if constexpr (N > 2) _tile_zero(2);
  if constexpr (N > 3) _tile_zero(3);
  for (int64_t d = 0; d < dim / (2 * kTile); ++d) {
    _tile_loadd(6, queries + d * kTile * kTile, 64);
    add_products<N>(keys + d * 2 * kTile, dim * 2, kTile * dim);
  }
  move_tiles<N, false>(s, kTile * kTile);
}

// outputs^T of N dim tiles (o: the first one, the next 256 floats on) += values^T (values:
// the first dim tile's first 32-key run, the next run kTileBf16 elements on, the next dim tile
// `dim_tile` on) times the weights^T of `steps` runs of 32 keys (weights: 16 key pairs × 16
// rows a run).
template <int N>
void value_tiles(const uint16_t* values, int64_t dim_tile, const uint32_t* weights,
                 int64_t steps, float* o) {
  move_tiles<N, true>(o, kTile * kTile);
  for (int64_t st = 0; st < steps; ++st) {
    _tile_loadd(6, weights + st * kTile * kTile, 64);
    add_products<N>(values + st * kTileBf16, 64, dim_tile);
  }
  move_tiles<N, false>(o, kTile * kTile);
}

using ScoreTiles = void (*)(const uint16_t*, int64_t, const uint32_t*, float*);
constexpr ScoreTiles kScoreTiles[kAccumulators + 1] = {
    nullptr, score_tiles<1>, score_tiles<2>, score_tiles<3>, score_tiles<4>};
using ValueTiles = void (*)(const uint16_t*, int64_t, const uint32_t*, int64_t, float*);
constexpr ValueTiles kValueTiles[kAccumulators + 1] = {
    nullptr, value_tiles<1>, value_tiles<2>, value_tiles<3>, value_tiles<4>};

// Index of each bf16 in a pair-interleaved row: (a[r], b[r]) for r = 0 .. 15, from
// [16 of a, 16 of b].
alignas(64) constexpr int16_t kPairOrder[2 * kTile] = {
    0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

inline __m512i pair_order() { return _mm512_load_si512(kPairOrder); }

// Lane i: 16 i, the offset of row i of a tile of 16-element rows (a column's scatter or
// gather).
inline __m512i tile_rows() {
  return _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(kTile));
}

// A KV head's keys and values for the tiles, from 32-key run `step`: keys as rows [32][dim],
// values^T as [dim / 16][16 dims][16 key pairs] (each a tile, runs kTileBf16 elements apart
// within a dim tile: `dim_tile` = steps * kTileBf16); keys past the context are zeros. A key
// pair's 16 dims of a tile go interleaved into pairs, then scattered down its column.
void pack_tile_run(const Chunk& c, int64_t h, int64_t step, int64_t dim_tile, uint16_t* keys,
                   uint16_t* values) {
  const __m512i order = pair_order(), rows = tile_rows();
  for (int64_t m = 0; m < kTile; ++m) {
    const uint16_t* v[2];
    for (int i = 0; i < 2; ++i) {
      const int64_t key = step * kValueStep + 2 * m + i;
      const uint16_t* k = cache_row(c, c.key_cache, h, key);
      uint16_t* row = keys + (2 * m + i) * c.dim;
      if (k == nullptr) {
        std::fill(row, row + c.dim, uint16_t{0});
      } else {
        std::memcpy(row, k, c.dim * sizeof(uint16_t));
      }
      v[i] = cache_row(c, c.value_cache, h, key);
    }
    for (int64_t t = 0; t < c.dim / kTile; ++t) {
      auto dims = [&](const uint16_t* value) {
        return value ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(value + t * kTile))
                     : _mm256_setzero_si256();
      };
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(dims(v[0])), dims(v[1]), 1);
      _mm512_i32scatter_epi32(reinterpret_cast<uint32_t*>(values + t * dim_tile) + m, rows,
                              _mm512_permutexvar_epi16(order, both), 4);
    }
  }
}

// Per-thread working memory of a task: per row tile its queries^T ([dim / 32] tiles of 16
// dim pairs × 16 rows), outputs^T ([dim][16] floats), running max and sum and each row's
// position (16 lanes); a span's scores^T ([kSpanKeys][16]) and weights^T ([kSpanKeys / 2][16]
// pairs); each row's output.
struct TileScratch {
  deepwell::TileVector<uint32_t> queries, weights;
  deepwell::TileVector<float> scores, out, max, sum;
  std::vector<int32_t> positions;
  std::vector<uint16_t*> rows;
};

// The softmax of one row tile over a span's `seen` keys (scores^T s, key by key): lanes whose
// last visible key is below `key` (their `last`, relative to the span) weigh it 0. Updates the
// running max and sum, rescales the outputs^T (o, dim rows), and writes the weights^T rounded
// to bf16 for whole runs of 32 keys (zeros past `seen`).
void tile_softmax(const float* s, int64_t seen, __m512i last, int64_t all_see, float scale,
                  float* max, float* sum, float* o, int64_t dim, uint32_t* weights) {
  const __m512 factor = _mm512_set1_ps(scale);
  auto lanes_seeing = [&](int64_t key) {
    return _mm512_cmpge_epi32_mask(last, _mm512_set1_epi32(static_cast<int32_t>(key)));
  };
  // The raw scores' max, scaled after: rounding keeps the order, so it is the scaled ones'.
  // Four running maxima, apart from one another's latency.
  __m512 tops[4];
  for (auto& top : tops) top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t k = 0;
  for (; k + 4 <= all_see; k += 4) {
    for (int i = 0; i < 4; ++i) {
      tops[i] = _mm512_max_ps(tops[i], _mm512_loadu_ps(s + (k + i) * kTile));
    }
  }
  for (; k < all_see; ++k) tops[0] = _mm512_max_ps(tops[0], _mm512_loadu_ps(s + k * kTile));
  for (; k < seen; ++k) {
    tops[1] = _mm512_mask_max_ps(tops[1], lanes_seeing(k), tops[1], _mm512_loadu_ps(s + k * kTile));
  }
  const __m512 top = _mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3]));
  const __m512 old_max = _mm512_loadu_ps(max);
  const __m512 new_max = _mm512_max_ps(old_max, _mm512_mul_ps(top, factor));
  // Lanes whose max stays keep their outputs as they are (and a lane that has seen nothing
  // yet, -inf both, no NaN).
  const __mmask16 moved = _mm512_cmp_ps_mask(new_max, old_max, _CMP_NEQ_UQ);
  const __m512 alpha =
      _mm512_mask_mov_ps(_mm512_set1_ps(1.f), moved, exp2_ps<5>(_mm512_sub_ps(old_max, new_max)));
  _mm512_storeu_ps(max, new_max);
  if (moved) {
    for (int64_t d = 0; d < dim; ++d) {
      _mm512_storeu_ps(o + d * kTile, _mm512_mul_ps(_mm512_loadu_ps(o + d * kTile), alpha));
    }
  }
  const __m512i order = pair_order();
  __m512 total = _mm512_setzero_ps();
  const int64_t width = (seen + kValueStep - 1) / kValueStep * kValueStep;
  for (k = 0; k < width; k += 2) {
    __m512 p[2];
    for (int i = 0; i < 2; ++i) {
      const int64_t key = k + i;
      if (key >= seen) {
        p[i] = _mm512_setzero_ps();
        continue;
      }
      p[i] = exp2_ps<5>(_mm512_fmsub_ps(_mm512_loadu_ps(s + key * kTile), factor, new_max));
      if (key >= all_see) p[i] = _mm512_maskz_mov_ps(lanes_seeing(key), p[i]);
      total = _mm512_add_ps(total, p[i]);
    }
    const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p[1], p[0]));
    _mm512_storeu_si512(weights + k / 2 * kTile, _mm512_permutexvar_epi16(order, halves));
  }
  _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_loadu_ps(sum), alpha, total));
}

// One task on tiles: KV head h, query positions [begin, end), every query head of the group,
// over the head's packed keys (rows) and values^T.
void run_tile_task(const Chunk& c, TileScratch& w, int64_t h, int64_t begin, int64_t end,
                   const uint16_t* keys, const uint16_t* values, int64_t dim_tile) {
  const int64_t group = c.heads / c.kv_heads;
  const int64_t rows = (end - begin) * group;
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  const int64_t offset = c.context_len - c.length;  // position of row 0 of the chunk
  const int64_t dim = c.dim, pairs = dim / 2, dim_tiles = dim / kTile;
  // queries^T: pair p of row r of tile t at [t][p][r], each row's pairs scattered down its
  // column 16 at a time; lanes past the rows are zeros, at a position no key reaches.
  const __m512i column = tile_rows();
  for (int64_t r = 0; r < row_tiles * kTile; ++r) {
    uint32_t* dst = w.queries.data() + (r / kTile) * pairs * kTile + r % kTile;
    const int64_t position = begin + r / group, head = h * group + r % group;
    const auto* q = r < rows
        ? reinterpret_cast<const uint32_t*>(c.q + position * c.q_row + head * dim)
        : nullptr;
    for (int64_t p = 0; p < pairs; p += kTile) {
      const __m512i row_pairs = q ? _mm512_loadu_si512(q + p) : _mm512_setzero_si512();
      _mm512_i32scatter_epi32(dst + p * kTile, column, row_pairs, 4);
    }
    w.positions[r] = q ? static_cast<int32_t>(offset + position)
                       : std::numeric_limits<int32_t>::min() / 2;
    if (q) w.rows[r] = c.out + position * c.out_row + head * dim;
  }
  std::fill(w.out.begin(), w.out.begin() + row_tiles * dim * kTile, 0.f);
  std::fill(w.max.begin(), w.max.begin() + row_tiles * kTile,
            -std::numeric_limits<float>::infinity());
  std::fill(w.sum.begin(), w.sum.begin() + row_tiles * kTile, 0.f);
  const float scale = c.scale * 1.4426950408889634f;  // base 2, as tile_step's
  const int64_t last_key = offset + end - 1;
  for (int64_t span = 0; span <= last_key; span += kSpanKeys) {
    for (int64_t t = 0; t < row_tiles; ++t) {
      const int64_t first = t * kTile, count = std::min(kTile, rows - first);
      // Each row's last key from the span's start (lanes past the rows: far below 0).
      const __m512i last = _mm512_sub_epi32(_mm512_loadu_si512(w.positions.data() + first),
                                            _mm512_set1_epi32(static_cast<int32_t>(span)));
      const int64_t tile_last = w.positions[first + count - 1] - span;
      if (tile_last < 0) continue;  // causal: the tile's rows see none of the span
      const int64_t seen = std::min(tile_last + 1, kSpanKeys);
      const int64_t all_see =
          count < kTile ? 0 : std::clamp<int64_t>(w.positions[first] - span + 1, 0, seen);
      const int64_t key_tiles = (seen + kTile - 1) / kTile;
      float* s = w.scores.data();
      const uint32_t* queries = w.queries.data() + t * pairs * kTile;
      for (int64_t k = 0; k < key_tiles; k += kAccumulators) {
        kScoreTiles[std::min(kAccumulators, key_tiles - k)](
            keys + (span + k * kTile) * dim, dim, queries, s + k * kTile * kTile);
      }
      float* o = w.out.data() + t * dim * kTile;
      tile_softmax(s, seen, last, all_see, scale, w.max.data() + first, w.sum.data() + first, o,
                   dim, w.weights.data());
      const int64_t steps = (seen + kValueStep - 1) / kValueStep;
      for (int64_t d = 0; d < dim_tiles; d += kAccumulators) {
        kValueTiles[std::min(kAccumulators, dim_tiles - d)](
            values + d * dim_tile + span / kValueStep * kTileBf16, dim_tile, w.weights.data(),
            steps, o + d * kTile * kTile);
      }
    }
  }
  // outputs^T / sum, rounded to bf16, into each row: a row's dims gathered from its lane.
  const __m512i lane_step = tile_rows();
  for (int64_t r = 0; r < rows; ++r) {
    const float* lane = w.out.data() + (r / kTile) * dim * kTile + r % kTile;
    const __m512 inverse = _mm512_set1_ps(1.f / w.sum[r]);
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512 lo = _mm512_mul_ps(
          _mm512_i32gather_ps(lane_step, lane + d * kTile, 4), inverse);
      const __m512 hi = _mm512_mul_ps(
          _mm512_i32gather_ps(lane_step, lane + (d + 16) * kTile, 4), inverse);
      _mm512_storeu_si512(w.rows[r] + d, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
}

void attend_on_tiles(const Chunk& c) {
  // Each KV head's keys and values in whole 32-key runs: 32 * dim elements a run each.
  const int64_t steps = (c.context_len + kValueStep - 1) / kValueStep;
  const int64_t head = steps * kValueStep * c.dim;
  const int64_t dim_tile = steps * kTileBf16;
  deepwell::TileVector<uint16_t> keys(c.kv_heads * head), values(c.kv_heads * head);
  at::parallel_for(0, c.kv_heads * steps, 16, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t h = t / steps, step = t % steps;
      pack_tile_run(c, h, step, dim_tile, keys.data() + h * head + step * kValueStep * c.dim,
                    values.data() + h * head + step * kTileBf16);
    }
  });
  const int64_t query_blocks = (c.length + kPositions - 1) / kPositions;
  const int64_t tasks = c.kv_heads * query_blocks;
  const int64_t row_tiles = (kPositions * (c.heads / c.kv_heads) + kTile - 1) / kTile;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    deepwell::load_full_tile_config();
    TileScratch w;
    w.queries.resize(row_tiles * c.dim / 2 * kTile);
    w.out.resize(row_tiles * c.dim * kTile);
    w.max.resize(row_tiles * kTile);
    w.sum.resize(row_tiles * kTile);
    w.positions.resize(row_tiles * kTile);
    w.rows.resize(row_tiles * kTile);
    w.scores.resize(kSpanKeys * kTile);
    w.weights.resize(kSpanKeys / 2 * kTile);
    // Latest query blocks first, as attend hands them out.
    for (int64_t t = next++; t < tasks; t = next++) {
      const int64_t qb = query_blocks - 1 - t / c.kv_heads, h = t % c.kv_heads;
      const int64_t begin = qb * kPositions;
      run_tile_task(c, w, h, begin, std::min(c.length, begin + kPositions),
                    keys.data() + h * head, values.data() + h * head, dim_tile);
    }
    _tile_release();
  });
}

#endif  // DEEPWELL_PREFILL_AMX

Products products_named(c10::string_view name) {
  if (name == "native") return kNativeProducts;
  if (name == "dpbf16") return Products::kDotBf16;
  TORCH_CHECK(name == "fma", "prefill attention: products must be native, amx, dpbf16 or fma, "
              "not ", name);
  return Products::kFma;
}

#endif  // DEEPWELL_PREFILL_BF16

bool vectorised() {
#if defined(DEEPWELL_PREFILL_BF16)
  return true;
#else
  return false;
#endif
}

// Whether the AMX form runs here: built with the tile flags, and Linux gave this process the
// tile state.
bool on_tiles() {
#if defined(DEEPWELL_PREFILL_AMX)
  return deepwell::amx_tiles_permitted();
#else
  return false;
#endif
}

// out [length, heads, dim] = causal attention of q [length, heads, dim] (the chunk's rows,
// any row stride) over the first context_len keys of the paged caches
// [num_blocks, kv_heads, block_size, dim] through block_table; all bfloat16. products: the
// form of the bf16 products, "amx" (`attend_on_tiles`) or one of `Products`; unless named,
// tiles where they run (on_tiles), else this CPU's faster vector form (the tests run the
// vector forms both and compare their bits).
void chunk_attention(
    const at::Tensor& q,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& block_table,
    int64_t context_len,
    double scale,
    const at::Tensor& out,
    c10::string_view products) {
  TORCH_CHECK(vectorised(), "prefill attention: this build has no AVX512_BF16 path");
  TORCH_CHECK(
      q.scalar_type() == at::kBFloat16 && key_cache.scalar_type() == at::kBFloat16 &&
          value_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
      "prefill attention: q, the caches and out must be bfloat16");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "prefill attention: q and out must be "
              "[length, heads, head_dim] alike, got ", q.sizes(), " and ", out.sizes());
  TORCH_CHECK(
      key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
          key_cache.is_contiguous() && value_cache.is_contiguous(),
      "prefill attention: the caches must be contiguous [num_blocks, kv_heads, block_size, "
      "head_dim] alike");
  const int64_t length = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == dim, "prefill attention: q's head_dim ", dim,
              " is not the caches' ", key_cache.size(3));
  TORCH_CHECK(dim % 64 == 0, "prefill attention: head_dim must be a multiple of 64, got ", dim);
  TORCH_CHECK(heads % kv_heads == 0, "prefill attention: ", heads,
              " query heads do not group over ", kv_heads, " KV heads");
  TORCH_CHECK(
      q.stride(2) == 1 && q.stride(1) == dim && out.stride(2) == 1 && out.stride(1) == dim,
      "prefill attention: q's and out's heads must be contiguous within a row");
  TORCH_CHECK(length >= 1 && context_len >= length, "prefill attention: a chunk of ", length,
              " rows cannot end a context of ", context_len, " keys");
  TORCH_CHECK(
      block_table.scalar_type() == at::kLong && block_table.dim() == 1 &&
          block_table.is_contiguous(),
      "prefill attention: block_table must be a contiguous int64 vector");
  const int64_t needed = (context_len + block_size - 1) / block_size;
  TORCH_CHECK(block_table.size(0) >= needed, "prefill attention: ", context_len, " keys need ",
              needed, " blocks, the table has ", block_table.size(0));
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t num_blocks = key_cache.size(0);
  for (int64_t i = 0; i < needed; ++i) {
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "prefill attention: block id ",
                table[i], " is outside the cache's ", num_blocks, " blocks");
  }
#if defined(DEEPWELL_PREFILL_BF16)
  const Chunk chunk{
      reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
      q.stride(0),
      reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
      out.stride(0),
      reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>()),
      reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>()),
      table,
      length,
      context_len,
      heads,
      kv_heads,
      block_size,
      dim,
      static_cast<float>(scale)};
  if (products == "amx" || (products == "native" && on_tiles())) {
    TORCH_CHECK(on_tiles(), "prefill attention: products amx need AMX tiles, which this build "
                "or this process lacks (decode_kernel.py builds them where torch runs AVX-512 "
                "on a CPU with amx_bf16)");
#if defined(DEEPWELL_PREFILL_AMX)
    attend_on_tiles(chunk);
#endif
    return;
  }
  switch (products_named(products)) {
    case Products::kDotBf16:
      attend<Products::kDotBf16>(chunk);
      break;
    case Products::kFma:
      attend<Products::kFma>(chunk);
      break;
  }
#endif
}

}  // namespace

TORCH_LIBRARY(deepwell_prefill, m) {
  m.def("vectorised() -> bool", &vectorised);
  m.def("on_tiles() -> bool", &on_tiles);
  m.def(
      "chunk_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_table, "
      "int context_len, float scale, Tensor(a!) out, str products=\"native\") -> ()");
}

TORCH_LIBRARY_IMPL(deepwell_prefill, CPU, m) {
  m.impl("chunk_attention", &chunk_attention);
}
