// A whole decode step of a Llama-family model in one call: every layer's RMSNorm, GGUF-block
// linears (quant_gemv.cpp), rotary, K/V store and paged attention (paged_decode.cpp), for a
// few rows; built with those sources into one extension by layers/decode_kernel.py.
//
// The step's threads stay in one OpenMP region for the whole step: each takes a contiguous
// share of every linear's tiles and a share of the KV heads, quantises each linear's input
// itself (all alike, so none waits for another's), and the threads meet at a spinning
// barrier between dependent phases, five a layer. A region per linear and attention (a
// fork and a join each, ~150 a step) with the norms and quantisation on one thread between
// them left a batch-1 step at half the memory limit.
//
// Between the linears everything is float32 in buffers allocated once: the step's glue
// (norms, rotary, residuals, silu) costs a batch-1 step more than its linears when each op is
// a torch call that finds the caches cold; here it is a few short loops over data the
// previous linear just wrote. The caches keep the engine's dtype (float32 or bfloat16): K, V
// and q are rounded to it for the attention kernel, as the torch path stores them.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
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

// Where the step's threads meet between dependent phases. A thread that arrives early
// prefetches the start of its share of the next weight into L2 while it waits, so that the
// memory stays busy across the meeting; past a short spin it yields, since on a loaded
// machine the thread it waits for may be off its core for a time slice.
class StepBarrier {
 public:
  void wait(int threads, std::pair<const uint8_t*, int64_t> next) {
    const unsigned generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    const int64_t prefetch = std::min(next.second, kWaitPrefetchBytes);
    int64_t fetched = 0, spins = 0;
    while (generation_.load(std::memory_order_acquire) == generation) {
      if (fetched < prefetch) {
        for (int line = 0; line < 4; ++line, fetched += 64) __builtin_prefetch(next.first + fetched, 0, 2);
      } else if (++spins < kSpins) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  // About a tenth of a weight share (SmolLM2's gate_up: 550 KB a thread at 2 threads),
  // well inside any L2 of these CPUs.
  static constexpr int64_t kWaitPrefetchBytes = 64 * 1024;
  // Pauses before yielding: ~5-30 us (a pause is 40-140 cycles on these CPUs), about a
  // phase's imbalance at batch 1 (an attention of one KV head more). Not longer: on a machine
  // with more runnable threads than cores (other processes, or the engine's own thread
  // planning the next step when it schedules asynchronously) the thread waited for is often
  // off its core, and a yield hands it this one at once.
  static constexpr int64_t kSpins = 512;
  alignas(64) std::atomic<int> arrived_{0};
  // Unsigned: it wraps around after 2^32 meetings, as it may.
  alignas(64) std::atomic<unsigned> generation_{0};
};

// What one step's threads share: its rows, their metadata and caches, where its outputs go.
struct Step {
  int64_t rows;
  const int64_t* position;
  const int64_t* slot_block;
  const int64_t* slot_offset;
  const int64_t* block_ids;
  const int64_t* block_starts;
  const int64_t* context_lens;
  const std::vector<at::Tensor>* key_caches;
  const std::vector<at::Tensor>* value_caches;
  float* hidden;
  float* logits;  // null without a head
};

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
    qkv_.assign(kMaxRows * qkv, 0.f);
    attention_.assign(kMaxRows * heads * head_dim, 0.f);
    gate_up_.assign(kMaxRows * 2 * intermediate, 0.f);
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
    auto out = at::empty({rows, hidden_}, at::kFloat);
    std::optional<at::Tensor> logits;
    if (head_.has_value()) logits = at::empty({rows, head_->view.out_features}, at::kFloat);
    const Step step{rows,
                    position,
                    slot_block,
                    slot_offset,
                    block_ids.data_ptr<int64_t>(),
                    block_starts.data_ptr<int64_t>(),
                    context_lens.data_ptr<int64_t>(),
                    &key_caches,
                    &value_caches,
                    out.data_ptr<float>(),
                    logits.has_value() ? logits->data_ptr<float>() : nullptr};
    // Nothing in the region throws: every argument is checked above.
#pragma omp parallel num_threads(at::get_num_threads())
    step_part(step, omp_get_thread_num(), omp_get_num_threads());
    return {out, logits};
  }

  // The output head (its quant_weight, like a layer's linears) over `vocab` outputs, its
  // input rounded through bfloat16 where the engine computes in it; the logits are the
  // float32 sums (layers/float32_head.py).
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

  // Thread `part` of `parts`: every layer, then the final norm and its share of the head.
  // The residual stream x_ is added to by the o and down shares (their outputs are disjoint)
  // and read by every thread's norms only between meetings, which order the two.
  void step_part(const Step& step, int part, int parts) {
    // This thread's copy of the next linear's input (normed or activated rows).
    thread_local std::vector<float> input;
    input.resize(kMaxRows * std::max(hidden_, intermediate_));
    const int64_t rows = step.rows;
    const auto share = [&](const Linear& w) { return deepwell::tile_share(w.view, part, parts); };
    const auto meet = [&](const Linear& next) {
      barrier_.wait(parts, deepwell::share_bytes(next.view, share(next)));
    };
    for (int64_t l = 0; l < num_layers(); ++l) {
      const Layer& layer = layers_[l];
      rms_norm(x_.data(), layer.input_norm.data_ptr<float>(), rows, hidden_, eps_, input.data());
      linear(layer.qkv, share(layer.qkv), input.data(), rows, hidden_, false, qkv_.data());
      meet(layer.o);
      attend(step, l, kv_heads_ * part / parts, kv_heads_ * (part + 1) / parts);
      meet(layer.o);
      linear(layer.o, share(layer.o), attention_.data(), rows, heads_ * head_dim_, true, x_.data());
      meet(layer.gate_up);
      rms_norm(x_.data(), layer.post_norm.data_ptr<float>(), rows, hidden_, eps_, input.data());
      linear(layer.gate_up, share(layer.gate_up), input.data(), rows, hidden_, false, gate_up_.data());
      meet(layer.down);
      silu_times_up(rows, input.data());
      linear(layer.down, share(layer.down), input.data(), rows, intermediate_, true, x_.data());
      if (l + 1 < num_layers()) {
        meet(layers_[l + 1].qkv);
      } else if (head_.has_value()) {
        meet(*head_);
      } else {
        barrier_.wait(parts, {nullptr, 0});
      }
    }
    rms_norm(x_.data(), final_norm_.data_ptr<float>(), rows, hidden_, eps_, input.data());
    if (part == 0) std::memcpy(step.hidden, input.data(), rows * hidden_ * sizeof(float));
    if (!head_.has_value()) return;
    // The head called from Python takes the hidden state in the engine's dtype (Float32Head):
    // round alike, for equal logits.
    if (head_bf16_) round_to_bf16(input.data(), rows * hidden_);
    deepwell::block_linear_share(input.data(), rows, hidden_, head_->view, share(*head_), false, step.logits);
  }

  // This thread's share of a linear's outputs (plus its bias), stored or added to out.
  static void linear(const Linear& w, deepwell::TileShare share, const float* x, int64_t rows,
                     int64_t in_features, bool add, float* out) {
    const auto [first, last] = deepwell::block_linear_share(x, rows, in_features, w.view, share, add, out);
    if (!w.bias.defined()) return;
    const float* bias = w.bias.data_ptr<float>();
    const int64_t n = w.view.out_features;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = first; i < last; ++i) out[r * n + i] += bias[i];
    }
  }

  // Rotary on each row's q and k heads [begin, end) (indices into the qkv row's heads), in
  // place: layers/rotary.py's x * cos + x rolled by half a head * signed sin (HF's
  // rotate_half form; the sin's first half negated).
  void rotate(const int64_t* position, int64_t rows, int64_t begin, int64_t end) {
    const int64_t half = head_dim_ / 2, width = (heads_ + 2 * kv_heads_) * head_dim_;
    for (int64_t r = 0; r < rows; ++r) {
      const float* cos = cos_.data_ptr<float>() + position[r] * head_dim_;
      const float* sin = signed_sin_.data_ptr<float>() + position[r] * head_dim_;
      for (int64_t h = begin; h < end; ++h) {
        float* x = qkv_.data() + r * width + h * head_dim_;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          x[i] = a * cos[i] + b * sin[i];
          x[i + half] = b * cos[i + half] + a * sin[i + half];
        }
      }
    }
  }

  // Layer l's attention for KV heads [kv_begin, kv_end) and their query heads: rotary, each
  // row's K and V into its slot, then the attention; its output heads into attention_. A
  // thread reads only the cache heads it wrote, so the heads need no meeting between.
  void attend(const Step& step, int64_t l, int64_t kv_begin, int64_t kv_end) {
    if (kv_begin == kv_end) return;
    const int64_t group = heads_ / kv_heads_;
    rotate(step.position, step.rows, kv_begin * group, kv_end * group);
    rotate(step.position, step.rows, heads_ + kv_begin, heads_ + kv_end);
    const at::Tensor& keys = (*step.key_caches)[l];
    const at::Tensor& values = (*step.value_caches)[l];
    if (keys.scalar_type() == at::kBFloat16) {
      attend_heads<at::BFloat16>(step, keys, values, kv_begin, kv_end);
    } else {
      attend_heads<float>(step, keys, values, kv_begin, kv_end);
    }
  }

  // T: the caches' dtype; q and the output are rounded through it as the torch path's are.
  template <typename T>
  void attend_heads(const Step& step, const at::Tensor& key_cache, const at::Tensor& value_cache,
                    int64_t kv_begin, int64_t kv_end) {
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const int64_t width = q_size + 2 * kv_size, block_size = key_cache.size(2);
    const int64_t rows = step.rows;
    T* keys = key_cache.data_ptr<T>();
    T* values = value_cache.data_ptr<T>();
    for (int64_t r = 0; r < rows; ++r) {
      const float* k = qkv_.data() + r * width + q_size;
      const float* v = k + kv_size;
      for (int64_t h = kv_begin; h < kv_end; ++h) {
        const int64_t at =
            ((step.slot_block[r] * kv_heads_ + h) * block_size + step.slot_offset[r]) * head_dim_;
        for (int64_t i = 0; i < head_dim_; ++i) {
          keys[at + i] = static_cast<T>(k[h * head_dim_ + i]);
          values[at + i] = static_cast<T>(v[h * head_dim_ + i]);
        }
      }
    }
    // The heads' span of a row: [first, last) of its q_size values.
    const int64_t group_size = heads_ / kv_heads_ * head_dim_;
    const int64_t first = kv_begin * group_size, last = kv_end * group_size;
    const auto heads = [&](const void* q, int64_t q_row, void* out) {
      deepwell::paged_decode_heads(q, q_row, rows, heads_, key_cache, value_cache, step.block_ids,
                                   step.block_starts, step.context_lens, scale_, out, kv_begin,
                                   kv_end);
    };
    if constexpr (std::is_same_v<T, float>) {
      // q read in place: the first q_size values of each qkv row.
      heads(qkv_.data(), width, attention_.data());
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = first; i < last; ++i) q16_[r * q_size + i] = static_cast<T>(qkv_[r * width + i]);
      }
      heads(q16_.data(), q_size, out16_.data());
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = first; i < last; ++i) attention_[r * q_size + i] = static_cast<float>(out16_[r * q_size + i]);
      }
    }
  }

  static void round_to_bf16(float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<at::BFloat16>(x[i]));
  }

  // act = silu(gate) * up per row, into this thread's `act`; gate_up rows hold gate then up
  // (models/llama.py).
  void silu_times_up(int64_t rows, float* act) const {
    for (int64_t r = 0; r < rows; ++r) {
      const float* gate = gate_up_.data() + r * 2 * intermediate_;
      at::vec::map2<float>(
          [](Vec g, Vec u) { return g / (Vec(1.f) + g.neg().exp()) * u; },
          act + r * intermediate_, gate, gate + intermediate_, intermediate_);
    }
  }

  const int64_t hidden_, heads_, kv_heads_, head_dim_, intermediate_;
  const float eps_, scale_;
  at::Tensor embedding_, cos_, signed_sin_, final_norm_;
  std::vector<Layer> layers_;
  std::optional<Linear> head_;
  bool head_bf16_ = false;
  // Float32 buffers of kMaxRows rows, shared by the step's threads and reused by every call
  // (one call at a time).
  std::vector<float> x_, qkv_, attention_, gate_up_;
  std::vector<at::BFloat16> q16_, out16_;
  StepBarrier barrier_;
};

}  // namespace

namespace deepwell {
// llama_dense_decode.cpp: the decoder of dense weights, in this module beside this one.
void bind_dense_decoder(pybind11::module_& m);
}  // namespace deepwell

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
  deepwell::bind_dense_decoder(m);
}
