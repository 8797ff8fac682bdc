"""How an AMX tile product (TDPBF16PS) rounds its bf16 products, against the FMA form the
prefill chunk attention's products take (prefill_attention.cpp, `Products::kFma`).

The FMA form adds each pair's odd product, then its even one, to the running float32 sum,
each sum rounded to nearest even under DAZ and FTZ: VDPBF16PS's bits. On random and
adversarial 16 x 16 outputs of two tile products each (64 products an output onto a float32
accumulator: ordinary values, float32's whole exponent range, products near and below its
smallest normal, overflows, cancelling pairs; accumulators of zeros, denormals and any
value), the script counts the lanes on which the tile result equals
  - the FMA form (the kernel's pair order, and with each pair's halves swapped),
  - a model of the tile product: per tile product and output, the even products summed in
    k order from zero, the odd ones alike, each sum rounded (to nearest even, DAZ, FTZ);
    the two chains' sum rounded, then added to the accumulator and rounded,
  - tiles holding one product an output (the only packing whose sums are the FMA form's:
    the accumulator plus one product, rounded once), against the FMA form,
and times a tile product and a 512-bit FMA, back to back on independent accumulators (thread
CPU time). Needs a CPU with AMX bf16 tiles; says why not elsewhere.

    PYTHONPATH=. .venv/bin/python benchmarks/amx_tile_rounding.py [--trials 4000]
"""

import argparse
import os

from torch.utils.cpp_extension import load_inline

from deepwell.engine.layers.decode_kernel import amx_tiles_lacking

CHECK = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <ctime>
#include <random>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// Every tile 16 rows of 64 bytes; the tile state asked of Linux first (amx_linear.cpp).
void start_tiles() {
  TORCH_CHECK(syscall(SYS_arch_prctl, 0x1023, 18) == 0, "the kernel refused the AMX tile state");
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  // The whole configuration as the operand: gcc 12's _tile_loadconfig names only its first
  // 8 bytes, and the stores of the rest were dropped as dead.
  asm volatile("ldtilecfg %0" : : "m"(config));
}

float widened(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

bool same(float a, float b) { return bits(a) == bits(b) || (a != a && b != b); }

float fma1(float a, float b, float c) {
  return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
}
float add1(float a, float b) { return _mm_cvtss_f32(_mm_add_ss(_mm_set_ss(a), _mm_set_ss(b))); }

// Two tile products' operands: a [2][16 rows][16 pairs], b [2][16 pairs][16 outputs], as
// bf16 pairs (element 2k + 0 the low half); c [16][16] float32.
struct Trial {
  alignas(64) uint16_t a[2][16][32];
  alignas(64) uint16_t b[2][16][32];
  alignas(64) float c[16][16];
};

// The references, under DAZ, FTZ and round to nearest even (set by the caller): out of line,
// so that no operation moves across the MXCSR changes. odd_first: the kernel's pair order.
__attribute__((noinline)) void fma_form(const Trial& t, bool odd_first, float (*out)[16]) {
  for (int m = 0; m < 16; ++m) {
    for (int n = 0; n < 16; ++n) {
      float acc = t.c[m][n];
      for (int s = 0; s < 2; ++s) {
        for (int k = 0; k < 16; ++k) {
          const float p0a = widened(t.a[s][m][2 * k]), p0b = widened(t.b[s][k][2 * n]);
          const float p1a = widened(t.a[s][m][2 * k + 1]), p1b = widened(t.b[s][k][2 * n + 1]);
          acc = odd_first ? fma1(p0a, p0b, fma1(p1a, p1b, acc)) : fma1(p1a, p1b, fma1(p0a, p0b, acc));
        }
      }
      out[m][n] = acc;
    }
  }
}

__attribute__((noinline)) void two_chains(const Trial& t, float (*out)[16]) {
  for (int m = 0; m < 16; ++m) {
    for (int n = 0; n < 16; ++n) {
      float acc = t.c[m][n];
      for (int s = 0; s < 2; ++s) {
        float even = 0.f, odd = 0.f;
        for (int k = 0; k < 16; ++k) {
          even = fma1(widened(t.a[s][m][2 * k]), widened(t.b[s][k][2 * n]), even);
          odd = fma1(widened(t.a[s][m][2 * k + 1]), widened(t.b[s][k][2 * n + 1]), odd);
        }
        acc = add1(add1(even, odd), acc);
      }
      out[m][n] = acc;
    }
  }
}

class DotBf16Modes {
 public:
  DotBf16Modes() {
    asm volatile("stmxcsr %0" : "=m"(saved_) : : "memory");
    const unsigned modes = (saved_ & ~0x6000u) | 0x8040u | 0x1F80u;
    asm volatile("ldmxcsr %0" : : "m"(modes) : "memory");
  }
  ~DotBf16Modes() { asm volatile("ldmxcsr %0" : : "m"(saved_) : "memory"); }

 private:
  unsigned saved_;
};

// The two tile products in order onto c, the caller's MXCSR in force.
void tiles(const Trial& t, float (*out)[16]) {
  _tile_loadd(0, t.c, 64);
  for (int s = 0; s < 2; ++s) {
    _tile_loadd(1, t.a[s], 64);
    _tile_loadd(2, t.b[s], 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, out, 64);
}

// The same 64 products an output as 64 tile products of one product an output each, in the
// FMA form's order: row m's factor alone in the A tile's first element, output n's in
// element 2n of the B tile's first row.
void one_product_tiles(const Trial& t, float (*out)[16]) {
  alignas(64) uint16_t a[16][32] = {}, b[16][32] = {};
  _tile_loadd(0, t.c, 64);
  for (int s = 0; s < 2; ++s) {
    for (int k = 0; k < 16; ++k) {
      for (int half = 1; half >= 0; --half) {
        for (int m = 0; m < 16; ++m) a[m][0] = t.a[s][m][2 * k + half];
        for (int n = 0; n < 16; ++n) b[0][2 * n] = t.b[s][k][2 * n + half];
        _tile_loadd(1, a, 64);
        _tile_loadd(2, b, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
    }
  }
  _tile_stored(0, out, 64);
}

constexpr int kKinds = 6;

// A bf16 of input kind `kind`: 0 ordinary (2^-7 .. 2^7), 1 any finite exponent, 2 tiny (a
// quarter denormal), 3 huge (products overflow), 4 products near float32's smallest normal.
uint16_t bf16_of(std::mt19937_64& rng, int kind) {
  const uint64_t r = rng();
  const uint16_t sign = (r & 1) << 15, mantissa = (r >> 1) & 0x7F;
  const uint64_t pick = r >> 8;
  int exponent;
  switch (kind) {
    case 1: exponent = pick % 255; break;
    case 2: exponent = pick % 4 == 0 ? 0 : 1 + (pick >> 2) % 30; break;
    case 3: exponent = 200 + pick % 55; break;
    case 4: exponent = 60 + pick % 10; break;
    default: exponent = 120 + pick % 15; break;
  }
  return sign | uint16_t(exponent << 7) | mantissa;
}

float accumulator(std::mt19937_64& rng) {
  const uint64_t r = rng();
  const uint32_t sign = r & 0x80000000u;
  uint32_t u;
  switch (r % 4) {
    case 0: u = 0; break;
    case 1: u = sign | (rng() & 0x7FFFFF); break;
    case 2: u = sign | uint32_t(100 + rng() % 60) << 23 | (rng() & 0x7FFFFF); break;
    default: u = sign | uint32_t(rng() % 255) << 23 | (rng() & 0x7FFFFF); break;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Kind 5: ordinary values whose pairs cancel on the diagonal outputs (m = n), exactly or
// nearly.
void fill(Trial& t, std::mt19937_64& rng, int kind) {
  const int values = kind == 5 ? 0 : kind;
  for (int s = 0; s < 2; ++s) {
    for (int i = 0; i < 16; ++i) {
      for (int j = 0; j < 32; ++j) {
        t.a[s][i][j] = bf16_of(rng, values);
        t.b[s][i][j] = bf16_of(rng, values);
      }
    }
  }
  if (kind == 5) {
    for (int s = 0; s < 2; ++s) {
      for (int k = 0; k < 16; ++k) {
        for (int n = 0; n < 16; ++n) {
          t.a[s][n][2 * k + 1] = t.a[s][n][2 * k];
          t.b[s][k][2 * n + 1] = t.b[s][k][2 * n] ^ 0x8000 ^ (rng() & 1);
        }
      }
    }
  }
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 16; ++j) t.c[i][j] = accumulator(rng);
  }
}

}  // namespace

// [kinds, 6] lane counts a kind: outputs, NaN tile outputs, tile == the FMA form, tile == the
// FMA form with pairs' halves swapped, tile == the two-chain model, one-product tiles == the
// FMA form.
torch::Tensor compare(int64_t trials, int64_t seed) {
  start_tiles();
  std::mt19937_64 rng(seed);
  auto counts = torch::zeros({kKinds, 6}, torch::kLong);
  auto* count = counts.data_ptr<int64_t>();
  Trial t;
  alignas(64) float tile[16][16], single[16][16], kernel[16][16], swapped[16][16], model[16][16];
  for (int64_t trial = 0; trial < trials; ++trial) {
    const int kind = trial % kKinds;
    fill(t, rng, kind);
    tiles(t, tile);
    one_product_tiles(t, single);
    {
      const DotBf16Modes modes;
      fma_form(t, true, kernel);
      fma_form(t, false, swapped);
      two_chains(t, model);
    }
    int64_t* row = count + kind * 6;
    for (int m = 0; m < 16; ++m) {
      for (int n = 0; n < 16; ++n) {
        row[0] += 1;
        row[1] += tile[m][n] != tile[m][n];
        row[2] += same(tile[m][n], kernel[m][n]);
        row[3] += same(tile[m][n], swapped[m][n]);
        row[4] += same(tile[m][n], model[m][n]);
        row[5] += same(single[m][n], kernel[m][n]);
      }
    }
  }
  _tile_release();
  return counts;
}

double thread_seconds() {
  timespec now;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return now.tv_sec + 1e-9 * now.tv_nsec;
}

// ns a tile product (four independent accumulator tiles) and ns a 512-bit FMA (twelve
// independent accumulators), back to back.
std::vector<double> rates(int64_t rounds) {
  start_tiles();
  alignas(64) static uint16_t ones[16][32];
  alignas(64) static float zeros[16][16];
  for (auto& row : ones) for (auto& v : row) v = 0x3f80;
  _tile_loadd(0, zeros, 64);
  _tile_loadd(1, zeros, 64);
  _tile_loadd(2, zeros, 64);
  _tile_loadd(3, zeros, 64);
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  double started = thread_seconds();
  for (int64_t i = 0; i < rounds; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const double tile_ns = (thread_seconds() - started) * 1e9 / (4.0 * rounds);
  _tile_release();
  // Accumulators zeroed after the clock call (which may use them) and operands 1 and 0: no
  // denormal assists; the same registers kept across the rounds (clobbered, so the operands
  // live elsewhere).
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  started = thread_seconds();
  asm volatile(
      "vxorps %%zmm0, %%zmm0, %%zmm0\n\tvxorps %%zmm1, %%zmm1, %%zmm1\n\t"
      "vxorps %%zmm2, %%zmm2, %%zmm2\n\tvxorps %%zmm3, %%zmm3, %%zmm3\n\t"
      "vxorps %%zmm4, %%zmm4, %%zmm4\n\tvxorps %%zmm5, %%zmm5, %%zmm5\n\t"
      "vxorps %%zmm6, %%zmm6, %%zmm6\n\tvxorps %%zmm7, %%zmm7, %%zmm7\n\t"
      "vxorps %%zmm8, %%zmm8, %%zmm8\n\tvxorps %%zmm9, %%zmm9, %%zmm9\n\t"
      "vxorps %%zmm10, %%zmm10, %%zmm10\n\tvxorps %%zmm11, %%zmm11, %%zmm11\n\t"
      ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
      "xmm10", "xmm11");
  for (int64_t i = 0; i < rounds; ++i) {
    asm volatile(
        "vfmadd231ps %0, %1, %%zmm0\n\tvfmadd231ps %0, %1, %%zmm1\n\t"
        "vfmadd231ps %0, %1, %%zmm2\n\tvfmadd231ps %0, %1, %%zmm3\n\t"
        "vfmadd231ps %0, %1, %%zmm4\n\tvfmadd231ps %0, %1, %%zmm5\n\t"
        "vfmadd231ps %0, %1, %%zmm6\n\tvfmadd231ps %0, %1, %%zmm7\n\t"
        "vfmadd231ps %0, %1, %%zmm8\n\tvfmadd231ps %0, %1, %%zmm9\n\t"
        "vfmadd231ps %0, %1, %%zmm10\n\tvfmadd231ps %0, %1, %%zmm11\n\t"
        : : "v"(one), "v"(zero)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "xmm10", "xmm11");
  }
  const double fma_ns = (thread_seconds() - started) * 1e9 / (12.0 * rounds);
  return {tile_ns, fma_ns};
}
"""

KINDS = (
    "ordinary (2^-7 .. 2^7)",
    "any finite exponent",
    "tiny, a quarter denormal",
    "huge (overflows)",
    "products near 2^-126",
    "cancelling pairs",
)
COLUMNS = ("FMA form", "halves swapped", "two chains", "one-product tiles")
# Products a tile product computes (16 x 16 outputs x 32) and a 512-bit FMA (16 lanes).
TILE_PRODUCTS, FMA_PRODUCTS = 16 * 16 * 32, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--rounds", type=int, default=2_000_000)
    args = parser.parse_args()
    lacking = amx_tiles_lacking()
    if lacking is not None:
        print(f"no tile products to check: {lacking}")
        return
    check = load_inline(
        "deepwell_amx_tile_rounding",
        cpp_sources=CHECK,
        functions=["compare", "rates"],
        extra_cflags=["-O2", "-march=native", "-mamx-tile", "-mamx-bf16"],
    )
    counts = check.compare(args.trials, args.seed).tolist()
    print(
        f"TDPBF16PS against the FMA form: {args.trials} trials of 16 x 16 outputs, 64 "
        f"products each; load average {os.getloadavg()[0]:.2f}"
    )
    print(f"  {'inputs':26s} {'outputs':>8s} {'NaN':>7s}  " + "  ".join(COLUMNS))
    for kind, (lanes, nans, *equal) in zip(KINDS, counts, strict=True):
        shares = "  ".join(
            f"{100 * e / lanes:{len(c)}.2f}" for e, c in zip(equal, COLUMNS, strict=True)
        )
        print(f"  {kind:26s} {lanes:8d} {nans:7d}  {shares}")
    print("  (% of outputs bit-equal, NaN equal to NaN)")
    tile_ns, fma_ns = check.rates(args.rounds)
    print(
        f"  a tile product {tile_ns:.2f} ns ({TILE_PRODUCTS / tile_ns:.0f} products/ns; one "
        f"an output: {16 * 16 / tile_ns:.0f}/ns), a 512-bit FMA {fma_ns:.3f} ns "
        f"({FMA_PRODUCTS / fma_ns:.0f} products/ns)"
    )


if __name__ == "__main__":
    main()
