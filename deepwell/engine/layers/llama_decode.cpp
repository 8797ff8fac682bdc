// A whole decode step of a Llama-family model in one call: every layer's RMSNorm, GGUF-block
// linears (quant_gemv.cpp), rotary, K/V store and paged attention (paged_decode.cpp), for a
// few rows; built with those sources into one extension by layers/decode_kernel.py.
//
// Between the linears everything is float32 in buffers allocated once: the step's glue
// (norms, rotary, residuals, silu) costs a batch-1 step more than its linears when each op is
// a torch call that finds the caches cold; here it is a few short loops over data the
// previous linear just wrote. The caches keep the engine's dtype (float32 or bfloat16): K, V
// and q are rounded to it for the attention kernel, as the torch path stores them.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/ops/empty.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernel_parts.h"

namespace {

using Vec = at::vec::Vectorized<float>;
using deepwell::kMaxRows;
using Weight = std::pair<std::string, at::Tensor>;

struct Linear {
  // Kept alive here: `view` points into it.
  at::Tensor weights, bias;
  deepwell::BlockLinear view;
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
};

// A quant_linear.py weight (its quant_weight, in quant_gemv.cpp's layout) of `kind` "Q4_1"
// or "Q8_0", and its float32 bias if it has one.
Linear make_linear(const std::string& kind, const at::Tensor& weights, int64_t in_features,
                   int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kind == "Q4_1" || kind == "Q8_0", "a linear's kind must be Q4_1 or Q8_0");
  TORCH_CHECK(in_features % 32 == 0, "a linear's in_features must be a multiple of 32");
  const bool q4_1 = kind == "Q4_1";
  const int64_t blocks = in_features / 32, tile = deepwell::kTileOutputs;
  TORCH_CHECK(weights.scalar_type() == at::kByte && weights.dim() == 2 && weights.is_contiguous() &&
                  weights.size(0) == (out_features + tile - 1) / tile &&
                  weights.size(1) == blocks * tile * (q4_1 ? deepwell::kQ4_1BlockBytes : deepwell::kQ8_0BlockBytes),
              "a linear's weights must be contiguous uint8 tiles of its blocks, [", out_features,
              ", ", in_features, "] in ", kind);
  Linear linear{weights, at::Tensor(), {}};
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out_features,
                "a bias must be float32 [out]");
    linear.bias = bias->contiguous();
  }
  linear.view = deepwell::BlockLinear{q4_1, weights.data_ptr<uint8_t>(), out_features, blocks};
  return linear;
}

at::Tensor float_vector(const at::Tensor& t, int64_t size, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == size, what, " must be float32 [",
              size, "]");
  return t.contiguous();
}

void rms_norm(const float* x, const float* weight, int64_t rows, int64_t n, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) deepwell::rms_norm_row(x + r * n, weight, n, eps, out + r * n);
}

class LlamaDecoder {
 public:
  LlamaDecoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
               int64_t intermediate, double eps, at::Tensor embedding, at::Tensor cos,
               at::Tensor signed_sin, at::Tensor final_norm)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim),
        intermediate_(intermediate), eps_(static_cast<float>(eps)),
        scale_(1.f / std::sqrt(static_cast<float>(head_dim))) {
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0, "heads must group evenly over KV heads");
    TORCH_CHECK(embedding.dim() == 2 && embedding.size(1) == hidden && embedding.is_contiguous() &&
                    (embedding.scalar_type() == at::kFloat || embedding.scalar_type() == at::kBFloat16),
                "the embedding must be contiguous float32 or bfloat16 [vocab, hidden]");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) == head_dim &&
                    signed_sin.sizes() == cos.sizes() && signed_sin.scalar_type() == at::kFloat,
                "cos and signed_sin must be float32 [positions, head_dim]");
    embedding_ = embedding;
    cos_ = cos.contiguous();
    signed_sin_ = signed_sin.contiguous();
    final_norm_ = float_vector(final_norm, hidden, "the final norm");
    const int64_t qkv = (heads + 2 * kv_heads) * head_dim;
    x_.assign(kMaxRows * hidden, 0.f);
    normed_.assign(kMaxRows * hidden, 0.f);
    added_.assign(kMaxRows * hidden, 0.f);
    qkv_.assign(kMaxRows * qkv, 0.f);
    attention_.assign(kMaxRows * heads * head_dim, 0.f);
    gate_up_.assign(kMaxRows * 2 * intermediate, 0.f);
    act_.assign(kMaxRows * intermediate, 0.f);
    q16_.assign(kMaxRows * heads * head_dim, at::BFloat16(0.f));
    out16_.assign(kMaxRows * heads * head_dim, at::BFloat16(0.f));
  }

  // Linears as (kind, quant_weight) pairs.
  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm, const Weight& qkv,
                 const std::optional<at::Tensor>& qkv_bias, const Weight& o,
                 const Weight& gate_up, const Weight& down) {
    const int64_t q_size = heads_ * head_dim_;
    layers_.push_back(Layer{
        float_vector(input_norm, hidden_, "an input norm"),
        float_vector(post_norm, hidden_, "a post-attention norm"),
        make_linear(qkv.first, qkv.second, hidden_, q_size + 2 * kv_heads_ * head_dim_, qkv_bias),
        make_linear(o.first, o.second, q_size, hidden_, std::nullopt),
        make_linear(gate_up.first, gate_up.second, hidden_, 2 * intermediate_, std::nullopt),
        make_linear(down.first, down.second, intermediate_, hidden_, std::nullopt),
    });
  }

  // The final-normed hidden state [rows, hidden] (float32) of a step of `rows` decode rows
  // (AttentionMetadata's slots and decode block lists), storing each layer's K/V; and the
  // logits [rows, vocab] (float32) where the decoder has the head (set_head), else None.
  std::pair<at::Tensor, std::optional<at::Tensor>> forward(const at::Tensor& ids, const at::Tensor& positions,
                     const std::vector<at::Tensor>& key_caches,
                     const std::vector<at::Tensor>& value_caches, const at::Tensor& slot_blocks,
                     const at::Tensor& slot_offsets, const at::Tensor& block_ids,
                     const at::Tensor& block_starts, const at::Tensor& context_lens) {
    const int64_t rows = ids.numel();
    TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "the native decode takes 1 to ", kMaxRows, " rows");
    for (const auto* t : {&ids, &positions, &slot_blocks, &slot_offsets, &block_ids, &block_starts,
                          &context_lens}) {
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                  "ids, positions and the slot and block metadata must be contiguous int64");
    }
    TORCH_CHECK(positions.numel() == rows && slot_blocks.numel() == rows &&
                    slot_offsets.numel() == rows && context_lens.numel() == rows &&
                    block_starts.numel() == rows + 1,
                "one position, slot and context length per row, one block start per row plus one");
    TORCH_CHECK(static_cast<int64_t>(key_caches.size()) == num_layers() &&
                    value_caches.size() == key_caches.size(),
                "one key and one value cache per layer");
    const auto& first = key_caches[0];
    const auto dtype = first.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "caches must be float32 or bfloat16");
    TORCH_CHECK(first.dim() == 4 && first.size(1) == kv_heads_ && first.size(3) == head_dim_,
                "caches must be [num_blocks, kv_heads, block_size, head_dim]");
    for (size_t l = 0; l < key_caches.size(); ++l) {
      for (const auto* c : {&key_caches[l], &value_caches[l]}) {
        TORCH_CHECK(c->is_contiguous() && c->scalar_type() == dtype && c->sizes() == first.sizes(),
                    "every cache must be contiguous, of one dtype and shape");
      }
    }
    const int64_t* id = ids.data_ptr<int64_t>();
    const int64_t* position = positions.data_ptr<int64_t>();
    const int64_t* slot_block = slot_blocks.data_ptr<int64_t>();
    const int64_t* slot_offset = slot_offsets.data_ptr<int64_t>();
    const int64_t num_blocks = first.size(0), block_size = first.size(2);
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(id[r] >= 0 && id[r] < embedding_.size(0), "token id ", id[r], " is out of the vocabulary");
      TORCH_CHECK(position[r] >= 0 && position[r] < cos_.size(0), "position ", position[r],
                  " is past the rotary table");
      TORCH_CHECK(slot_block[r] >= 0 && slot_block[r] < num_blocks && slot_offset[r] >= 0 &&
                      slot_offset[r] < block_size,
                  "slot out of the cache");
    }
    deepwell::check_block_lists(block_ids.data_ptr<int64_t>(), block_ids.numel(),
                                block_starts.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                                rows, num_blocks, block_size);
    if (embedding_.scalar_type() == at::kBFloat16) {
      embed<at::BFloat16>(id, rows);
    } else {
      embed<float>(id, rows);
    }
    for (int64_t l = 0; l < num_layers(); ++l) {
      const Layer& layer = layers_[l];
      rms_norm(x_.data(), layer.input_norm.data_ptr<float>(), rows, hidden_, eps_, normed_.data());
      linear(layer.qkv, normed_.data(), rows, hidden_, qkv_.data());
      rotate(position, rows);
      if (dtype == at::kBFloat16) {
        attend<at::BFloat16>(key_caches[l], value_caches[l], rows, slot_block, slot_offset,
                             block_ids, block_starts, context_lens);
      } else {
        attend<float>(key_caches[l], value_caches[l], rows, slot_block, slot_offset, block_ids,
                      block_starts, context_lens);
      }
      linear(layer.o, attention_.data(), rows, heads_ * head_dim_, added_.data());
      add_to_residual(rows);
      rms_norm(x_.data(), layer.post_norm.data_ptr<float>(), rows, hidden_, eps_, normed_.data());
      linear(layer.gate_up, normed_.data(), rows, hidden_, gate_up_.data());
      silu_times_up(rows);
      linear(layer.down, act_.data(), rows, intermediate_, added_.data());
      add_to_residual(rows);
    }
    auto out = at::empty({rows, hidden_}, at::kFloat);
    float* hidden = out.data_ptr<float>();
    rms_norm(x_.data(), final_norm_.data_ptr<float>(), rows, hidden_, eps_, hidden);
    if (!head_.has_value()) return {out, std::nullopt};
    auto logits = at::empty({rows, head_->view.out_features}, at::kFloat);
    if (head_bf16_) {
      // The head called from Python takes the hidden state in the engine's dtype and gives
      // its logits in it (models/llama.py compute_logits): round alike, for equal values.
      round_to_bf16(hidden, rows * hidden_, normed_.data());
      linear(*head_, normed_.data(), rows, hidden_, logits.data_ptr<float>());
      round_to_bf16(logits.data_ptr<float>(), logits.numel(), logits.data_ptr<float>());
    } else {
      linear(*head_, hidden, rows, hidden_, logits.data_ptr<float>());
    }
    return {out, logits};
  }

  // The output head (its quant_weight, like a layer's linears) over `vocab` outputs, the
  // logits rounded through bfloat16 where the engine computes in it.
  void set_head(const Weight& head, int64_t vocab, bool bf16) {
    head_ = make_linear(head.first, head.second, hidden_, vocab, std::nullopt);
    head_bf16_ = bf16;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  template <typename E>
  void embed(const int64_t* id, int64_t rows) {
    const E* table = embedding_.data_ptr<E>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < hidden_; ++i) {
        x_[r * hidden_ + i] = static_cast<float>(table[id[r] * hidden_ + i]);
      }
    }
  }

  void linear(const Linear& w, const float* x, int64_t rows, int64_t in_features, float* out) {
    deepwell::block_linear(x, rows, in_features, w.view, out);
    if (!w.bias.defined()) return;
    const float* bias = w.bias.data_ptr<float>();
    const int64_t n = w.view.out_features;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < n; ++i) out[r * n + i] += bias[i];
    }
  }

  // Rotary on each row's q and k heads, in place: layers/rotary.py's x * cos + x rolled by
  // half a head * signed sin (HF's rotate_half form; the sin's first half negated).
  void rotate(const int64_t* position, int64_t rows) {
    const int64_t half = head_dim_ / 2, width = (heads_ + 2 * kv_heads_) * head_dim_;
    for (int64_t r = 0; r < rows; ++r) {
      const float* cos = cos_.data_ptr<float>() + position[r] * head_dim_;
      const float* sin = signed_sin_.data_ptr<float>() + position[r] * head_dim_;
      for (int64_t h = 0; h < heads_ + kv_heads_; ++h) {
        float* x = qkv_.data() + r * width + h * head_dim_;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          x[i] = a * cos[i] + b * sin[i];
          x[i + half] = b * cos[i + half] + a * sin[i + half];
        }
      }
    }
  }

  // K and V of each row into its slot, then the attention of the step's q; the output into
  // attention_ (float32). T: the caches' dtype.
  template <typename T>
  void attend(const at::Tensor& key_cache, const at::Tensor& value_cache, int64_t rows,
              const int64_t* slot_block, const int64_t* slot_offset, const at::Tensor& block_ids,
              const at::Tensor& block_starts, const at::Tensor& context_lens) {
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const int64_t width = q_size + 2 * kv_size, block_size = key_cache.size(2);
    T* keys = key_cache.data_ptr<T>();
    T* values = value_cache.data_ptr<T>();
    for (int64_t r = 0; r < rows; ++r) {
      const float* k = qkv_.data() + r * width + q_size;
      const float* v = k + kv_size;
      for (int64_t h = 0; h < kv_heads_; ++h) {
        const int64_t at = ((slot_block[r] * kv_heads_ + h) * block_size + slot_offset[r]) * head_dim_;
        for (int64_t i = 0; i < head_dim_; ++i) {
          keys[at + i] = static_cast<T>(k[h * head_dim_ + i]);
          values[at + i] = static_cast<T>(v[h * head_dim_ + i]);
        }
      }
    }
    const int64_t* ids = block_ids.data_ptr<int64_t>();
    const int64_t* starts = block_starts.data_ptr<int64_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    if constexpr (std::is_same_v<T, float>) {
      // q read in place: the first q_size values of each qkv row.
      deepwell::paged_decode_rows(qkv_.data(), width, rows, heads_, key_cache, value_cache, ids, starts,
                                  lens, scale_, attention_.data());
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < q_size; ++i) q16_[r * q_size + i] = static_cast<T>(qkv_[r * width + i]);
      }
      deepwell::paged_decode_rows(q16_.data(), q_size, rows, heads_, key_cache, value_cache, ids, starts,
                                  lens, scale_, out16_.data());
      for (int64_t i = 0; i < rows * q_size; ++i) attention_[i] = static_cast<float>(out16_[i]);
    }
  }

  static void round_to_bf16(const float* x, int64_t n, float* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<at::BFloat16>(x[i]));
  }

  void add_to_residual(int64_t rows) {
    at::vec::map2<float>([](Vec a, Vec b) { return a + b; }, x_.data(), x_.data(), added_.data(),
                         rows * hidden_);
  }

  // act = silu(gate) * up per row; gate_up rows hold gate then up (models/llama.py).
  void silu_times_up(int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* gate = gate_up_.data() + r * 2 * intermediate_;
      at::vec::map2<float>(
          [](Vec g, Vec u) { return g / (Vec(1.f) + g.neg().exp()) * u; },
          act_.data() + r * intermediate_, gate, gate + intermediate_, intermediate_);
    }
  }

  const int64_t hidden_, heads_, kv_heads_, head_dim_, intermediate_;
  const float eps_, scale_;
  at::Tensor embedding_, cos_, signed_sin_, final_norm_;
  std::vector<Layer> layers_;
  std::optional<Linear> head_;
  bool head_bf16_ = false;
  // Float32 buffers of kMaxRows rows, reused by every call (one call at a time).
  std::vector<float> x_, normed_, added_, qkv_, attention_, gate_up_, act_;
  std::vector<at::BFloat16> q16_, out16_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<LlamaDecoder>(m, "LlamaDecoder")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, at::Tensor, at::Tensor,
                    at::Tensor, at::Tensor>(),
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("intermediate"), py::arg("eps"), py::arg("embedding"), py::arg("cos"),
           py::arg("signed_sin"), py::arg("final_norm"))
      .def("add_layer", &LlamaDecoder::add_layer, "one decoder layer's norms and block weights")
      .def("set_head", &LlamaDecoder::set_head, py::arg("head"), py::arg("vocab"), py::arg("bf16"),
           "the output head's block weight: forward then returns the logits too")
      .def("forward", &LlamaDecoder::forward, py::call_guard<py::gil_scoped_release>(),
           "a decode step of up to 8 rows through every layer: (the final-normed hidden state, "
           "the logits or None)")
      .def_property_readonly("num_layers", &LlamaDecoder::num_layers);
  m.attr("max_rows") = kMaxRows;
}
