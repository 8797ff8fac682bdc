"""What bounds int4's prompt linears on AMX tiles (issue 33 item 2): the tile unit's rates for
the two kernels one could write, and oneDNN's packed bf16 (what PackedLinear runs for calls of
more than 8 rows) against amx_linear.cpp (our bf16 tile kernel) on SmolLM2-135M's shapes.

Tile probes, ns a tile product (thread CPU time, one core):
  - bf16 (TDPBF16PS, 16 x 16 outputs x 32 inputs) and int8 (TDPBUSD) over 64 inputs and over
    one Q4_1 block of 32, four independent accumulators, no loads: the unit's rates;
  - int8 over one block with Q4_1's per-block scaling: each 16 x 16 int32 result leaves its
    tile, is converted and scaled by dx[row] * d[output] into float32 sums (what a kernel on
    the GGUF blocks with activations rounded per 32-block, as quant_gemv.cpp rounds them,
    must do after every tile product: the scales change every 32 inputs);
  - bf16 2 x 2 register blocking (4 result tiles, 2 input and 2 weight tiles a step, all 8
    tiles) over 18 blocks (in = 576): operands in L1; inputs streamed from a 576 KiB L2-resident
    buffer (512 rows, what a prompt chunk's pass over one weight pair reads); and that with
    every 32 x 32 result block stored as bf16 rows (4 tile stores, convert, 32 row stores);
    both operands kept in L1 by splitting the depth into 4-block pieces, the result tiles
    stored and reloaded around each piece.

Linears: per shape and row count, the best of `--rounds` interleaved rounds of oneDNN,
amx_linear.cpp and, at one thread, candidate (a) as far as it went (`tuned_linear` below; its
bits are amx_linear.cpp's), thread CPU time at one thread, wall time at more, TF/s; with
--cold, the 30 layers' distinct weights in model order, as a prompt meets them. Needs AMX
tiles; says why not elsewhere.

    PYTHONPATH=. .venv/bin/python benchmarks/amx_prompt_linears.py [--rows 128 256 512 1024] \
        [--rounds 7] [--cold] [--threads 1]
"""

import argparse
import os
import time

import torch
from torch.utils.cpp_extension import load_inline

from deepwell.engine.layers.amx_linear import amx_kernel_ready, amx_linear, tile_layout
from deepwell.engine.layers.decode_kernel import amx_tiles_lacking

# SmolLM2-135M's linears (in, out): qkv, o, gate_up, down.
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LAYERS = 30

PROBES = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <ctime>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// Tiles 0-3 results, 4-5 inputs (`input_bytes` a row), 6-7 weights (`weight_rows` rows); the
// whole configuration as ldtilecfg's operand (gcc 12's _tile_loadconfig drops its stores).
void configure(int input_bytes, int weight_rows) {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  config.bytes_per_row[4] = config.bytes_per_row[5] = input_bytes;
  config.rows[6] = config.rows[7] = weight_rows;
  asm volatile("ldtilecfg %0" : : "m"(config));
}

void zero_results() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

double thread_seconds() {
  timespec now;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return now.tv_sec + 1e-9 * now.tv_nsec;
}

constexpr int kBlocks = 18;  // in = 576
constexpr int kStreamTiles = 2 * 16;  // 512 rows of inputs: 576 KiB

// ns a tile product of kind `kind` (the module docstring's order), `rounds` repeats.
double probe(int kind, int64_t rounds) {
  // 1 KiB tiles: stream [16 row-tile pairs][2][kBlocks], weights [kBlocks][2], scratch.
  static uint16_t* stream = static_cast<uint16_t*>(aligned_alloc(4096, kStreamTiles * kBlocks * 1024));
  alignas(64) static uint16_t weights[kBlocks][2][512];
  alignas(64) static float sums[32][32], scales[2][16];
  alignas(64) static int32_t results[4][16][16];
  alignas(64) static uint16_t out[32][32];
  alignas(64) static float partials[4][4][256];
  for (int64_t i = 0; i < int64_t(kStreamTiles) * kBlocks * 512; ++i) stream[i] = 0x3f80;
  for (auto& block : weights) for (auto& tile : block) for (auto& v : tile) v = 0x3f80;
  for (auto& row : scales) for (auto& v : row) v = 0.01f;
  configure(kind == 2 || kind == 3 ? 32 : 64, kind == 2 || kind == 3 ? 8 : 16);
  zero_results();
  _tile_loadd(4, weights[0][0], 64);
  _tile_loadd(5, weights[0][1], 64);
  _tile_loadd(6, weights[1][0], 64);
  _tile_loadd(7, weights[1][1], 64);
  const double started = thread_seconds();
  for (int64_t r = 0; r < rounds; ++r) {
    if (kind == 0) {
      for (int b = 0; b < kBlocks; ++b) {
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
    } else if (kind == 1 || kind == 2) {
      for (int b = 0; b < kBlocks; ++b) {
        _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
      }
    } else if (kind == 3) {
      for (int b = 0; b < kBlocks; ++b) {
        zero_results();
        _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
        _tile_stored(0, results[0], 64); _tile_stored(1, results[1], 64);
        _tile_stored(2, results[2], 64); _tile_stored(3, results[3], 64);
        for (int t = 0; t < 4; ++t) {
          const __m512 d = _mm512_load_ps(scales[t & 1]);
          for (int m = 0; m < 16; ++m) {
            float* sum = &sums[(t >> 1) * 16 + m][(t & 1) * 16];
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(scales[t >> 1][m]));
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(results[t][m]));
            _mm512_store_ps(sum, _mm512_fmadd_ps(dot, scale, _mm512_load_ps(sum)));
          }
        }
      }
    } else if (kind == 7) {
      // Both operands kept in L1 by splitting the depth: 2 row-tile pairs x 2 output pairs
      // over 4 blocks (16 + 16 KiB), their result tiles reloaded and stored each time.
      for (int i = 0; i < 2; ++i) {
        for (int j = 0; j < 2; ++j) {
          float* c = &partials[i * 2 + j][0][0];
          _tile_loadd(0, c, 64); _tile_loadd(1, c + 256, 64); _tile_loadd(2, c + 512, 64); _tile_loadd(3, c + 768, 64);
          for (int b = 0; b < 4; ++b) {
            _tile_loadd(4, stream + (i * 2 * kBlocks + b) * 512, 64);
            _tile_loadd(5, stream + ((i * 2 + 1) * kBlocks + b) * 512, 64);
            _tile_loadd(6, weights[4 * j + b][0], 64);
            _tile_loadd(7, weights[4 * j + b][1], 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
        }
      }
    } else {
      // 2 x 2 blocking over kBlocks: inputs from L1 (kind 4) or streamed (5, 6).
      const uint16_t* inputs = stream + (kind == 4 ? 0 : (r % (kStreamTiles / 2)) * 2 * kBlocks * 512);
      zero_results();
      for (int step = 0; step < kBlocks; ++step) {
        // In L1: 9 blocks' inputs and weights (36 KiB), twice.
        const int b = kind == 4 ? step % 9 : step;
        _tile_loadd(4, inputs + b * 512, 64);
        _tile_loadd(5, inputs + (kBlocks + b) * 512, 64);
        _tile_loadd(6, weights[b][0], 64);
        _tile_loadd(7, weights[b][1], 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      if (kind == 6) {
        _tile_stored(0, &sums[0][0], 128); _tile_stored(1, &sums[0][16], 128);
        _tile_stored(2, &sums[16][0], 128); _tile_stored(3, &sums[16][16], 128);
        for (int m = 0; m < 32; ++m) {
          const __m512bh row = _mm512_cvtne2ps_pbh(_mm512_load_ps(&sums[m][16]), _mm512_load_ps(&sums[m][0]));
          _mm512_store_si512(out[m], (__m512i)row);
        }
      }
    }
  }
  const double seconds = thread_seconds() - started;
  _tile_release();
  // Kind 7 makes 64 products a round, the others 4 a block.
  return seconds * 1e9 / (rounds * (kind == 7 ? 64.0 : kBlocks * 4.0));
}

}  // namespace

// Candidate (a) as far as it was taken: x [rows, in] bf16 (rows a multiple of 32, in of 32)
// repacked into contiguous 1 KiB input tiles, times `pairs` [out / 32, in / 32, 2, 16, 16, 2]
// (both weight tiles of an output pair and block side by side, packed at load); 2 x 2
// blocking; every output pair's weights (L1) against all rows' inputs (L2, up to 1 MiB of
// them a chunk), the next pair's weights prefetched into L2 meanwhile; each 32 x 32 result
// block rounded to bf16 while the next block's products run. One thread, no bias.
torch::Tensor tuned_linear(torch::Tensor x, torch::Tensor pairs) {
  TORCH_CHECK(syscall(SYS_arch_prctl, 0x1023, 18) == 0, "the kernel refused the AMX tile state");
  const int64_t rows = x.size(0), blocks = x.size(1) / 32, out_pairs = pairs.size(0);
  TORCH_CHECK(rows % 32 == 0 && x.size(1) % 32 == 0 && pairs.size(1) == blocks, "shapes");
  const int64_t row_tiles = rows / 16, out_features = out_pairs * 32;
  auto packed = torch::empty({row_tiles, blocks, 16, 32}, x.options());
  packed.copy_(x.view({row_tiles, 16, blocks, 32}).transpose(1, 2));
  auto out = torch::empty({rows, out_features}, x.options());
  const auto* xs = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* ws = reinterpret_cast<const uint16_t*>(pairs.data_ptr());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  configure(64, 16);
  alignas(64) float sums[2][32][32];
  int buffer = 0;
  uint16_t* pending = nullptr;
  const auto store = [&](const float* block, uint16_t* to) {
    for (int m = 0; m < 32; ++m) {
      const __m512bh row = _mm512_cvtne2ps_pbh(_mm512_load_ps(block + m * 32 + 16), _mm512_load_ps(block + m * 32));
      _mm512_storeu_si512(to + m * out_features, (__m512i)row);
    }
  };
  const int64_t chunk_tiles = std::max<int64_t>(2, (1 << 20) / (blocks * 1024) / 2 * 2);
  const int64_t pair_lines = blocks * 32;
  for (int64_t chunk = 0; chunk < row_tiles; chunk += chunk_tiles) {
    const int64_t chunk_end = std::min(row_tiles, chunk + chunk_tiles);
    const int64_t per_step = (pair_lines + (chunk_end - chunk) / 2 - 1) / ((chunk_end - chunk) / 2);
    for (int64_t pair = 0; pair < out_pairs; ++pair) {
      const uint16_t* w = ws + pair * blocks * 1024;
      const char* ahead = reinterpret_cast<const char*>(ws + (pair + 1) * blocks * 1024);
      int64_t fetched = pair + 1 < out_pairs ? 0 : pair_lines;
      for (int64_t rt = chunk; rt < chunk_end; rt += 2) {
        for (const int64_t until = std::min(pair_lines, fetched + per_step); fetched < until; ++fetched)
          _mm_prefetch(ahead + 64 * fetched, _MM_HINT_T1);
        const uint16_t* a0 = xs + rt * blocks * 512;
        const uint16_t* a1 = a0 + blocks * 512;
        zero_results();
        for (int64_t b = 0; b < blocks; ++b) {
          _tile_loadd(4, a0 + b * 512, 64);
          _tile_loadd(5, a1 + b * 512, 64);
          _tile_loadd(6, w + b * 1024, 64);
          _tile_loadd(7, w + b * 1024 + 512, 64);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
          if (b == std::min<int64_t>(1, blocks - 1) && pending != nullptr) {
            store(&sums[buffer ^ 1][0][0], pending);
            pending = nullptr;
          }
        }
        _tile_stored(0, &sums[buffer][0][0], 128); _tile_stored(1, &sums[buffer][0][16], 128);
        _tile_stored(2, &sums[buffer][16][0], 128); _tile_stored(3, &sums[buffer][16][16], 128);
        pending = os + rt * 16 * out_features + pair * 32;
        buffer ^= 1;
      }
    }
  }
  if (pending != nullptr) store(&sums[buffer ^ 1][0][0], pending);
  _tile_release();
  return out;
}

std::vector<double> probes(int64_t rounds) {
  TORCH_CHECK(syscall(SYS_arch_prctl, 0x1023, 18) == 0, "the kernel refused the AMX tile state");
  std::vector<double> ns;
  for (int kind = 0; kind < 8; ++kind) ns.push_back(probe(kind, kind == 3 ? rounds / 4 : rounds));
  return ns;
}
"""

PROBE_NAMES = (
    ("bf16, no loads (the unit's rate)", 32),
    ("int8 over 64 inputs, no loads", 64),
    ("int8 over one Q4_1 block (32), no loads", 32),
    ("int8 over one block + per-block scaling", 32),
    ("bf16 2x2, operands in L1", 32),
    ("bf16 2x2, inputs streamed from L2", 32),
    ("bf16 2x2, from L2, results stored as bf16", 32),
    ("bf16 2x2, depth split, operands in L1", 32),
)


def build_probes():
    return load_inline(
        "deepwell_amx_prompt_probes",
        cpp_sources=PROBES,
        functions=["probes", "tuned_linear"],
        extra_cflags=["-O2", "-march=native", "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
    )


def pair_layout(weight: torch.Tensor) -> torch.Tensor:
    """tuned_linear's weight: tile_layout's tiles with an output pair's two side by side."""
    tiles = tile_layout(weight)
    return tiles.view(tiles.shape[0] // 2, 2, *tiles.shape[1:]).transpose(1, 2).contiguous()


def tile_probes(module, rounds: int) -> None:
    bf16_ns = None
    print("tile probes, ns a 16 x 16 tile product (thread CPU), products a second:")
    for (name, inputs), ns in zip(PROBE_NAMES, module.probes(rounds), strict=True):
        bf16_ns = bf16_ns or ns
        rate = 2 * 16 * 16 * inputs / ns / 1e3
        print(f"  {name:44s} {ns:6.2f} ns  {rate:5.2f} T(FL)OP/s  {bf16_ns / ns:4.2f}x bf16's rate")


def linears(module, rows_list: list[int], rounds: int, cold: bool, threads: int) -> None:
    # Thread CPU time sees only the caller's thread: wall time where others share the work.
    clock = time.thread_time if threads == 1 else time.perf_counter
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS if cold else 1):
        layer = {}
        for name, (fan_in, fan_out) in SHAPES.items():
            weight = (torch.randn(fan_out, fan_in, generator=generator) * fan_in**-0.5).bfloat16()
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            layer[name] = (packed, tile_layout(weight), fan_out, pair_layout(weight))
        layers.append(layer)
    # Warm: one weight a shape, called 10 times a timing.
    passes = layers if cold else layers * 10
    calls = {
        "oneDNN": lambda x, w: torch.ops.mkldnn._linear_pointwise(
            x, w[0], None, "none", [None], ""
        ),
        "amx_linear": lambda x, w: amx_linear(x, w[1], None, w[2]),
    }
    if threads == 1:
        calls["tuned 2x2"] = lambda x, w: module.tuned_linear(x, w[3])
    print(
        f"linears, {'30 distinct layers (cold)' if cold else 'one weight a shape (warm)'}, "
        f"best of {rounds} interleaved rounds, {threads} thread(s), TF/s:"
    )
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=generator).bfloat16() for k in (576, 1536)}
        best: dict[str, dict[str, float]] = {kind: {} for kind in calls}
        for _ in range(rounds):
            for kind, call in calls.items():
                for name, (fan_in, _) in SHAPES.items():
                    started = clock()
                    for layer in passes:
                        call(xs[fan_in], layer[name])
                    seconds = (clock() - started) / len(passes)
                    best[kind][name] = min(best[kind].get(name, seconds), seconds)
        for kind, per in best.items():
            rates = " ".join(
                f"{name} {2 * rows * k * n / per[name] / 1e12:.2f}"
                for name, (k, n) in SHAPES.items()
            )
            print(f"  {rows:5d} rows {kind:10s} {rates}  sum {sum(per.values()) * 1e3:.3f} ms")
        onednn = sum(best["oneDNN"].values())
        ratios = ", ".join(f"{kind}'s {onednn / sum(best[kind].values()):.2f}" for kind in calls)
        print(f"  {rows:5d} rows oneDNN's time over {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--probe-rounds", type=int, default=20000)
    parser.add_argument("--cold", action="store_true", help="30 layers' distinct weights")
    parser.add_argument("--threads", type=int, default=1, help="for the linears (probes: one)")
    args = parser.parse_args()
    lacking = amx_tiles_lacking()
    if lacking is not None or not amx_kernel_ready():
        raise SystemExit(f"needs AMX tiles: {lacking or 'amx_linear.cpp did not build'}")
    print(f"load average {os.getloadavg()[0]:.1f}")
    module = build_probes()
    tile_probes(module, args.probe_rounds)
    torch.set_num_threads(args.threads)
    linears(module, args.rows, args.rounds, args.cold, args.threads)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
