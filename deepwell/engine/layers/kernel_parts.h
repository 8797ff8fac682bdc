// What the whole-step decoder (llama_decode.cpp) calls in the other kernel sources, compiled
// with them into one extension by layers/decode_kernel.py (DEEPWELL_ONE_EXTENSION), and the
// inline routines several sources share.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <new>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace deepwell {

// Two float vectors of src[0, 2 * Vectorized<float>::size()): bf16 widens exactly (at::vec's
// own conversion), float loads. The register passes of llama_glue.cpp and llama_rotary.cpp.
template <typename T>
inline std::tuple<at::vec::Vectorized<float>, at::vec::Vectorized<float>> load_pair(
    const T* src) {
  using Vec = at::vec::Vectorized<float>;
  if constexpr (std::is_same_v<T, float>) {
    return {Vec::loadu(src), Vec::loadu(src + Vec::size())};
  } else {
    return at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src));
  }
}

// silu(g) * u, silu(g) = g / (1 + exp(-g)): its division and exp_u20 define the bits, which
// llama_glue.cpp's silu_mul and amx_linear.cpp's silu_mul_linear share by computing this one
// expression. exp(-g) overflows to inf for g < -88: g / inf = -0, silu's limit there.
inline at::vec::Vectorized<float> silu_times(const at::vec::Vectorized<float>& g,
                                             const at::vec::Vectorized<float>& u) {
  return g / (at::vec::Vectorized<float>(1.0f) + g.neg().exp_u20()) * u;
}

// paged_decode.cpp. Every row's block list against a cache of num_blocks blocks: a bad one
// is an error before any is read, never a read outside the cache.
void check_block_lists(
    const int64_t* ids,
    int64_t num_ids,
    const int64_t* starts,
    const int64_t* lens,
    int64_t rows,
    int64_t num_blocks,
    int64_t block_size);

// paged_decode.cpp. Attention of `rows` decode rows for KV heads [kv_begin, kv_end) (and
// their query heads) on the calling thread, over contiguous caches
// [num_blocks, kv_heads, block_size, head_dim]; q [rows, heads, head_dim] (rows q_row apart,
// heads contiguous) and out contiguous alike, of the caches' dtype (float32 or bfloat16);
// block lists already checked. Each (row, KV head) as paged_decode computes it, so the bits
// do not depend on how the heads are shared out.
void paged_decode_heads(
    const void* q,
    int64_t q_row,
    int64_t rows,
    int64_t heads,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const int64_t* ids,
    const int64_t* starts,
    const int64_t* lens,
    float scale,
    void* out,
    int64_t kv_begin,
    int64_t kv_end);

// Bytes of one block of 32 weights of one output in quant_gemv.cpp's tiles: Q4_1 16 of
// nibbles, fp16 d and m; Q8_0 32 of int8, fp16 d, int16 Σq.
constexpr int64_t kQ4_1BlockBytes = 20;
constexpr int64_t kQ8_0BlockBytes = 36;
// Outputs per tile of quant_gemv.cpp's row-interleaved layout: one AVX-512 vector of int32.
constexpr int64_t kTileOutputs = 16;

// A weight in quant_gemv.cpp's layout (layers/quant_linear.py repacks it): ceil(out / 16)
// tiles of `blocks` Q4_1 or Q8_0 blocks of 16 outputs each.
struct BlockLinear {
  bool q4_1;
  const uint8_t* weights;
  int64_t out_features;
  int64_t blocks;
};

// Rows per block_linear call, which its kernels are instantiated for (register-held
// accumulators per row); the whole-step decoder runs steps of more rows on the torch path.
constexpr int64_t kMaxRows = 8;

// Part `part` of `parts` of a weight's tiles: a contiguous run [begin, end), so that each
// thread streams one range of it.
struct TileShare {
  int64_t begin, end;
};

inline TileShare tile_share(const BlockLinear& w, int part, int parts) {
  const int64_t tiles = (w.out_features + kTileOutputs - 1) / kTileOutputs;
  return {tiles * part / parts, tiles * (part + 1) / parts};
}

// quant_gemv.cpp. The bytes of a share's tiles: one contiguous range of the weight.
std::pair<const uint8_t*, int64_t> share_bytes(const BlockLinear& w, TileShare share);

// quant_gemv.cpp. The outputs [first, last) of the share's tiles of out [rows, out_features]
// = x [rows, in_features] times the weight, stored, or added to out's values where `add`
// (a residual); 1 to kMaxRows rows and in_features of the weight's blocks, which the caller
// has checked (it runs inside the whole-step decoder's parallel region, where nothing may
// throw). The calling thread quantises x (llama.cpp's q8_1, per 32-block) into its own
// buffer, so threads sharing a linear do not wait for one another's; a tile's bits do not
// depend on the share. Returns [first, last).
std::pair<int64_t, int64_t> block_linear_share(const float* x, int64_t rows, int64_t in_features,
                                               const BlockLinear& w, TileShare share, bool add,
                                               float* out);

#if defined(__AVX512F__)
// Lane i of the result: the sum of v[i]'s 16 lanes, 16 vectors reduced together in four
// shuffle rounds for about the cost of two horizontal sums (paged_decode.cpp's scores of 16
// keys).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {
    // Per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3) of a = v[2i], b = v[2i+1].
    pairs[i] = _mm512_add_ps(
        _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    // Per 128-bit lane: the lane's sums of v[4i], ..., v[4i+3].
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 low = _mm512_add_ps(
      _mm512_shuffle_f32x4(quads[0], quads[1], kEven), _mm512_shuffle_f32x4(quads[0], quads[1], kOdd));
  const __m512 high = _mm512_add_ps(
      _mm512_shuffle_f32x4(quads[2], quads[3], kEven), _mm512_shuffle_f32x4(quads[2], quads[3], kOdd));
  return _mm512_add_ps(
      _mm512_shuffle_f32x4(low, high, kEven), _mm512_shuffle_f32x4(low, high, kOdd));
}
#endif

// One row's RMSNorm in float32, in F.rms_norm's order: out = x / sqrt(mean(x²) + eps) * weight
// (llama_glue.cpp's fused norm and the native step's norms).
inline void rms_norm_row(const float* x, const float* weight, int64_t n, float eps, float* out) {
  using Vec = at::vec::Vectorized<float>;
  const float sum = at::vec::map_reduce_all<float>(
      [](Vec v) { return v * v; }, [](Vec a, Vec b) { return a + b; }, x, n);
  const float inverse = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  at::vec::map2<float>([inverse](Vec v, Vec w) { return v * Vec(inverse) * w; }, out, x, weight, n);
}

// Memory the tiles load from and store to starts on a cache line: a tile row across two lines
// ran a tile kernel at half speed (benchmarks/amx_prompt_linears.py's log section), and
// new[] and std::vector give 16 bytes.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using TileVector = std::vector<T, CacheLineAllocator<T>>;

#if defined(__AMX_TILE__) && defined(__linux__)
// Linux hands out the tile state only to a process that asked (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, 0x1023 and 18 in its uapi headers): asked once
// before the first tile instruction, whatever oneDNN did. amx_linear.cpp, prefill_attention.cpp.
inline bool amx_tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

// Palette 1 with every tile 16 rows of 64 bytes, on the calling thread (a thread's tile
// configuration is its own, and oneDNN loads its own between our calls).
inline void load_full_tile_config() {
  struct alignas(64) {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } config;
  // The whole configuration as the operand: gcc 12's _tile_loadconfig names only its first 8
  // bytes, so the stores of the rest may be dropped as dead (they were in
  // benchmarks/amx_tile_rounding.py's check, and ldtilecfg faulted).
  asm volatile("ldtilecfg %0" : : "m"(config));
}
#endif

}  // namespace deepwell
