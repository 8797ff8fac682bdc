// DeepSeek-V4.1's packed cache rows (spec §3.7, §4) unpacked, and window rows packed, one
// pass a row in place of chains of torch ops (models/deepseek_v41/cache_formats.py holds the
// torch versions and the byte layout). Built by layers/decode_kernel.py, registered as
// torch ops (torch.ops.deepwell_v41_cache.*), called by models/deepseek_v41/cache_storage.py.
//
//   unpack_fp8    uint8 [rows, C + ceil(C/32)] → float32 [rows, C]: e4m3 codes × 2^(e - 127);
//   unpack_e2m1   uint8 [rows, ceil(C/2) + ceil(C/G)] → float32 [rows, C]: two E2M1 codes a
//                 byte (channel 2i low) × the group's scale, an e4m3 byte per 16 (nvfp4) or a
//                 UE8M0 byte per 32 (mxfp4);
//   pack_fp8      float32 or bfloat16 [rows, C] → (the packed bytes, their values unpacked).
//
// Bit for bit what the torch versions give: a code's value times a power of two (or an e4m3
// scale: at most 3 + 4 significant bits in all) is exact in float32, and pack_fp8 rounds each
// value to e4m3 with c10's conversion, the one torch's .to(float8_e4m3fn) uses, after the
// same float32 products (tests/engine/models/deepseek_v41/test_cache_storage.py).

#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

constexpr int64_t kFp8Group = 32;
constexpr float kE4M3Max = 448.0f;
// Rows per parallel task: a decode step's few rows stay on the calling thread.
constexpr int64_t kGrainRows = 256;
// E2M1 codes 0..15: bit 3 the sign, bits 0-2 the magnitude.
constexpr float kE2M1[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                             -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A UE8M0 byte e is 2^(e - 127): the float32 with that exponent field (never 0 here: the
// formats' scales are at least 2^-126).
float ue8m0(uint8_t e) {
  const uint32_t bits = static_cast<uint32_t>(e) << 23;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

float e4m3(uint8_t byte) { return static_cast<float>(c10::Float8_e4m3fn(byte, c10::Float8_e4m3fn::from_bits())); }

at::Tensor rows_of(const at::Tensor& packed, int64_t row_bytes, const char* name) {
  TORCH_CHECK(
      packed.scalar_type() == at::kByte && packed.dim() >= 1 && packed.size(-1) == row_bytes,
      "deepwell_v41_cache: a packed ", name, " row is ", row_bytes, " uint8 bytes; got ",
      packed.scalar_type(), " rows of ", packed.dim() ? packed.size(-1) : 0);
  return packed.reshape({-1, row_bytes}).contiguous();
}

std::vector<int64_t> unpacked_shape(const at::Tensor& packed, int64_t channels) {
  std::vector<int64_t> shape(packed.sizes().begin(), packed.sizes().end());
  shape.back() = channels;
  return shape;
}

at::Tensor unpack_fp8(const at::Tensor& packed, int64_t channels) {
  TORCH_CHECK(channels > 0, "deepwell_v41_cache.unpack_fp8: channels must be positive");
  const int64_t row_bytes = channels + ceil_div(channels, kFp8Group);
  at::Tensor rows = rows_of(packed, row_bytes, "fp8");
  const int64_t count = rows.size(0);
  at::Tensor out = at::empty({count, channels}, rows.options().dtype(at::kFloat));
  const uint8_t* in = rows.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, count, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* codes = in + r * row_bytes;
      const uint8_t* scales = codes + channels;
      float* target = o + r * channels;
      for (int64_t c = 0; c < channels; ++c) target[c] = e4m3(codes[c]) * ue8m0(scales[c / kFp8Group]);
    }
  });
  return out.view(unpacked_shape(packed, channels));
}

at::Tensor unpack_e2m1(const at::Tensor& packed, int64_t channels, int64_t group, bool e4m3_scales) {
  TORCH_CHECK(
      channels > 0 && group > 0,
      "deepwell_v41_cache.unpack_e2m1: channels and group must be positive");
  const int64_t code_bytes = ceil_div(channels, 2);
  const int64_t row_bytes = code_bytes + ceil_div(channels, group);
  at::Tensor rows = rows_of(packed, row_bytes, e4m3_scales ? "nvfp4" : "mxfp4");
  const int64_t count = rows.size(0);
  at::Tensor out = at::empty({count, channels}, rows.options().dtype(at::kFloat));
  const uint8_t* in = rows.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, count, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* codes = in + r * row_bytes;
      const uint8_t* scales = codes + code_bytes;
      float* target = o + r * channels;
      for (int64_t c = 0; c < channels; ++c) {
        const uint8_t byte = codes[c / 2];
        const uint8_t code = (c % 2) ? (byte >> 4) : (byte & 0xF);
        const uint8_t s = scales[c / group];
        target[c] = kE2M1[code] * (e4m3_scales ? e4m3(s) : ue8m0(s));
      }
    }
  });
  return out.view(unpacked_shape(packed, channels));
}

// The smallest power of two >= x (positive float32), from its bits.
float power_of_two_ceiling(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0);
  const uint32_t result = exponent << 23;
  float value;
  std::memcpy(&value, &result, sizeof value);
  return value;
}

template <typename T>
void pack_fp8_rows(const T* x, int64_t count, int64_t channels, uint8_t* stored, float* values) {
  const int64_t groups = ceil_div(channels, kFp8Group);
  const int64_t row_bytes = channels + groups;
  // cache_formats._fp8_parts' constants, as float32 (torch multiplies a float32 tensor by a
  // Python number in float32).
  const float floor = static_cast<float>(1e-4);
  const float inverse_max = static_cast<float>(1.0 / 448.0);
  at::parallel_for(0, count, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * channels;
      uint8_t* codes = stored + r * row_bytes;
      float* target = values + r * channels;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = g * kFp8Group, last = std::min(channels, first + kFp8Group);
        float top = 0.0f;
        for (int64_t c = first; c < last; ++c) top = std::max(top, std::fabs(static_cast<float>(row[c])));
        const float scale = power_of_two_ceiling(std::max(top, floor) * inverse_max);
        for (int64_t c = first; c < last; ++c) {
          const float scaled = std::clamp(static_cast<float>(row[c]) / scale, -kE4M3Max, kE4M3Max);
          const c10::Float8_e4m3fn code(scaled);
          codes[c] = code.x;
          target[c] = static_cast<float>(code) * scale;
        }
        uint32_t bits;
        std::memcpy(&bits, &scale, sizeof bits);
        codes[channels + g] = static_cast<uint8_t>(bits >> 23);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> pack_fp8(const at::Tensor& x) {
  TORCH_CHECK(
      (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() >= 1 &&
          x.size(-1) > 0,
      "deepwell_v41_cache.pack_fp8: x must be float32 or bfloat16 [..., channels]");
  const int64_t channels = x.size(-1);
  const int64_t row_bytes = channels + ceil_div(channels, kFp8Group);
  at::Tensor rows = x.reshape({-1, channels}).contiguous();
  const int64_t count = rows.size(0);
  at::Tensor stored = at::empty({count, row_bytes}, rows.options().dtype(at::kByte));
  at::Tensor values = at::empty({count, channels}, rows.options().dtype(at::kFloat));
  if (rows.scalar_type() == at::kFloat) {
    pack_fp8_rows(rows.data_ptr<float>(), count, channels, stored.data_ptr<uint8_t>(),
                  values.data_ptr<float>());
  } else {
    pack_fp8_rows(rows.data_ptr<at::BFloat16>(), count, channels, stored.data_ptr<uint8_t>(),
                  values.data_ptr<float>());
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  std::vector<int64_t> stored_shape = shape;
  stored_shape.back() = row_bytes;
  return {stored.view(stored_shape), values.view(shape)};
}

}  // namespace

TORCH_LIBRARY(deepwell_v41_cache, m) {
  m.def("unpack_fp8(Tensor packed, int channels) -> Tensor");
  m.def("unpack_e2m1(Tensor packed, int channels, int group, bool e4m3_scales) -> Tensor");
  m.def("pack_fp8(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(deepwell_v41_cache, CPU, m) {
  m.impl("unpack_fp8", &unpack_fp8);
  m.impl("unpack_e2m1", &unpack_e2m1);
  m.impl("pack_fp8", &pack_fp8);
}

