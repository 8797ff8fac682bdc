// A decode step of a Llama-family model on dense weights (bf16 PackedLinear, float32
// nn.Linear) in one call: the kernels models/llama.py's layers call on the C++ attention
// backend, in their order, with their arguments, so the hidden state is the torch path's bit
// for bit. Compiled into the native decode step's extension after paged_decode.cpp
// (layers/decode_kernel.py), whose store and attention it calls as cpp_paged.py does.
//
// What it saves is the Python between the kernels: ~13 ops a layer through Python's
// dispatcher (~10+ us each with the frames around them) is ~9 ms of a 30-layer step, run on
// one core while the step's other threads wait; through c10's dispatcher an op costs a few us.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

// paged_decode.cpp's entry points, defined above this file in the extension's one unit.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_ids,
                        const at::Tensor& block_starts, const at::Tensor& context_lens,
                        const at::Tensor& sequence_starts, double scale, bool portable);
void paged_store(const at::Tensor& k, const at::Tensor& v, at::Tensor& key_cache,
                 at::Tensor& value_cache, const at::Tensor& slot_blocks,
                 const at::Tensor& slot_offsets);

// Its own namespace: the extension's one unit holds llama_decode.cpp's Layer and Linear too.
namespace deepwell::dense_decode {

// The torch ops the layers call, found once; their signatures are their kernels' own
// (llama_glue.cpp, llama_rotary.cpp, bf16_gemm.cpp, torch's mkldnn linear), as the
// dispatcher's typed calls require.
using AddRmsNorm = at::Tensor(at::Tensor, const std::optional<at::Tensor>&, const at::Tensor&,
                              double, at::ScalarType);
using SiluMul = at::Tensor(const at::Tensor&);
using Rotate = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
// bf16_gemm.cpp's panels and amx_linear.cpp's tiles take the same arguments.
using PanelLinear = at::Tensor(const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, int64_t, bool);
// amx_linear.cpp's gate_up with silu_mul in its stores.
using SiluTileLinear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
using PackedLinear = at::Tensor(const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, std::string_view,
                                c10::List<std::optional<at::Scalar>>,
                                std::optional<std::string_view>);

template <typename F>
c10::TypedOperatorHandle<F> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

struct Ops {
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm = find_op<AddRmsNorm>("deepwell_glue::add_rms_norm");
  c10::TypedOperatorHandle<SiluMul> silu_mul = find_op<SiluMul>("deepwell_glue::silu_mul");
  c10::TypedOperatorHandle<Rotate> rotate = find_op<Rotate>("deepwell_llama_rotary::rotate");
  c10::TypedOperatorHandle<PackedLinear> packed_linear =
      find_op<PackedLinear>("mkldnn::_linear_pointwise");
  // Found when a linear has panels or tiles: each kernel's ops exist only where it loaded.
  std::optional<c10::TypedOperatorHandle<PanelLinear>> panel_linear, tile_linear;
  std::optional<c10::TypedOperatorHandle<SiluTileLinear>> silu_tile_linear;
  // PackedLinear's `[None]`: no post-op scalars.
  c10::List<std::optional<at::Scalar>> no_scalars{std::vector<std::optional<at::Scalar>>{std::nullopt}};
};

// One linear as layers/packed_linear.py's PackedLinear.forward, float32_linear.py's
// RowPaddedLinear.forward or nn.Linear.forward runs it: the AMX tiles where it has them, the
// panels for calls of up to `panel_rows` rows where it has them, else oneDNN's packed weight
// where it has one, else F.linear on the plain weight (float32), over zero rows up to
// `padded_rows` where the call has from `min_padded_rows` to fewer than that many.
struct DenseLinear {
  at::Tensor weight, tiles, packed, panels;
  // The module's bias, and its float32 copy for the tiles and panels (their bias.float()).
  std::optional<at::Tensor> bias, panel_bias;
  int64_t out_features = 0;
  // 0 where the linear is not a RowPaddedLinear.
  int64_t min_padded_rows = 0, padded_rows = 0;

  at::Tensor forward(const at::Tensor& x, const Ops& ops, int64_t panel_rows) const {
    if (tiles.defined()) return ops.tile_linear->call(x, tiles, panel_bias, out_features, false);
    if (panels.defined() && x.size(0) <= panel_rows) {
      const bool strided = x.stride(-1) != 1 || x.stride(0) % 2 != 0;
      return ops.panel_linear->call(strided ? x.contiguous() : x, panels, panel_bias,
                                    out_features, false);
    }
    if (packed.defined()) {
      return ops.packed_linear.call(x, packed, bias, "none", ops.no_scalars, "");
    }
    const int64_t rows = x.size(0);
    if (rows >= min_padded_rows && rows < padded_rows) {
      at::Tensor padded = at::zeros({padded_rows, x.size(1)}, x.options());
      padded.narrow(0, 0, rows).copy_(x);
      return at::linear(padded, weight, bias).narrow(0, 0, rows);
    }
    return at::linear(x, weight, bias);
  }
};

// (weight, tiles or None, packed weight or None, panels or None, bias or None,
// (min_padded_rows, padded_rows)), from llama_native.py.
using LinearParts = std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>,
                               std::optional<at::Tensor>, std::optional<at::Tensor>,
                               std::tuple<int64_t, int64_t>>;

DenseLinear make_linear(const LinearParts& parts, int64_t in_features, int64_t out_features) {
  const auto& [weight, tiles, packed, panels, bias, padding] = parts;
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == out_features && weight.size(1) == in_features,
              "a linear's weight must be [", out_features, ", ", in_features, "]");
  TORCH_CHECK(!bias.has_value() || bias->numel() == out_features, "a bias must be [out]");
  DenseLinear linear;
  linear.weight = weight;
  linear.tiles = tiles.value_or(at::Tensor());
  linear.packed = packed.value_or(at::Tensor());
  linear.panels = panels.value_or(at::Tensor());
  linear.bias = bias;
  if (bias.has_value()) linear.panel_bias = bias->to(at::kFloat);
  linear.out_features = out_features;
  std::tie(linear.min_padded_rows, linear.padded_rows) = padding;
  return linear;
}

struct Layer {
  at::Tensor input_norm, post_norm;
  DenseLinear qkv, o, gate_up, down;
  // gate_up's tiles pair gate and up tiles (SiluGateUpLinear): its call gives silu_mul's.
  bool gate_up_silu = false;
};

// A step's rows: where each one's K/V goes and which blocks it reads (AttentionMetadata's).
struct StepRows {
  const at::Tensor &slot_blocks, &slot_offsets, &block_ids, &block_starts, &context_lens,
      &sequence_starts;
};

class LlamaDenseDecoder {
 public:
  LlamaDenseDecoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                    int64_t intermediate, double eps, double scale, int64_t panel_rows,
                    at::Tensor embedding, at::Tensor cos, at::Tensor signed_sin,
                    at::Tensor final_norm)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim),
        intermediate_(intermediate), eps_(eps), scale_(scale), panel_rows_(panel_rows),
        embedding_(std::move(embedding)), cos_(std::move(cos)),
        signed_sin_(std::move(signed_sin)), final_norm_(std::move(final_norm)) {
    TORCH_CHECK(embedding_.dim() == 2 && embedding_.size(1) == hidden,
                "the embedding must be [vocab, hidden]");
    TORCH_CHECK(cos_.dim() == 2 && cos_.size(1) == head_dim && signed_sin_.sizes() == cos_.sizes(),
                "cos and signed_sin must be [positions, head_dim]");
  }

  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm,
                 const LinearParts& qkv, const LinearParts& o, const LinearParts& gate_up,
                 const LinearParts& down, bool gate_up_silu) {
    const int64_t q_size = heads_ * head_dim_;
    Layer layer{input_norm, post_norm,
                make_linear(qkv, hidden_, q_size + 2 * kv_heads_ * head_dim_),
                make_linear(o, q_size, hidden_),
                make_linear(gate_up, hidden_, 2 * intermediate_),
                make_linear(down, intermediate_, hidden_), gate_up_silu};
    TORCH_CHECK(!gate_up_silu || layer.gate_up.tiles.defined(),
                "a gate_up with silu_mul in its stores runs on its tiles");
    if (gate_up_silu && !ops_.silu_tile_linear.has_value()) {
      ops_.silu_tile_linear = find_op<SiluTileLinear>("deepwell_amx_linear::silu_mul_linear");
    }
    for (const DenseLinear* linear : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) {
      if (linear->panels.defined() && !ops_.panel_linear.has_value()) {
        ops_.panel_linear = find_op<PanelLinear>("deepwell_bf16_gemm::linear");
      }
      if (linear->tiles.defined() && !ops_.tile_linear.has_value()) {
        ops_.tile_linear = find_op<PanelLinear>("deepwell_amx_linear::linear");
      }
    }
    layers_.push_back(std::move(layer));
  }

  // LlamaForCausalLM.forward of a step of decode rows: the final-normed hidden state
  // [rows, hidden] (float32), each layer's K/V stored in its cache. The ops check their
  // arguments as they do when Python calls them.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& positions,
                     const std::vector<at::Tensor>& key_caches,
                     const std::vector<at::Tensor>& value_caches, const at::Tensor& slot_blocks,
                     const at::Tensor& slot_offsets, const at::Tensor& block_ids,
                     const at::Tensor& block_starts, const at::Tensor& context_lens,
                     const at::Tensor& sequence_starts) {
    TORCH_CHECK(key_caches.size() == layers_.size() && value_caches.size() == layers_.size(),
                "one key and one value cache per layer");
    const StepRows rows{slot_blocks, slot_offsets, block_ids,
                        block_starts, context_lens, sequence_starts};
    at::Tensor x = at::embedding(embedding_, ids).to(at::kFloat);
    // RotaryEmbedding.lookup: [tokens, 1, head_dim], shared by every layer.
    const at::Tensor cos = cos_.index_select(0, positions).unsqueeze(1);
    const at::Tensor sin = signed_sin_.index_select(0, positions).unsqueeze(1);
    std::optional<at::Tensor> delta;
    for (size_t l = 0; l < layers_.size(); ++l) {
      delta = layer_forward(layers_[l], x, delta, cos, sin, rows, key_caches[l], value_caches[l]);
    }
    return ops_.add_rms_norm.call(x, delta, final_norm_, eps_, at::kFloat);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  // LlamaDecoderLayer.forward: x (the float32 residual stream) updated in place, the
  // previous layer's MLP output `delta` added first; returns this layer's MLP output.
  at::Tensor layer_forward(const Layer& layer, at::Tensor& x, const std::optional<at::Tensor>& delta,
                           const at::Tensor& cos, const at::Tensor& sin, const StepRows& rows,
                           at::Tensor key_cache, at::Tensor value_cache) const {
    const auto dtype = layer.down.weight.scalar_type();
    at::Tensor h = ops_.add_rms_norm.call(x, delta, layer.input_norm, eps_, dtype);
    // LlamaAttention.forward.
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const auto qkv = layer.qkv.forward(h, ops_, panel_rows_).split_with_sizes({q_size + kv_size, kv_size}, -1);
    const at::Tensor qk = ops_.rotate.call(qkv[0].view({-1, heads_ + kv_heads_, head_dim_}), cos, sin);
    const auto q_k = qk.split_with_sizes({heads_, kv_heads_}, 1);
    const at::Tensor v = qkv[1].view({-1, kv_heads_, head_dim_});
    // CppPagedAttention: _store, then _decode (the step has no prefills).
    paged_store(q_k[1], v, key_cache, value_cache, rows.slot_blocks, rows.slot_offsets);
    const at::Tensor out = paged_decode(q_k[0], key_cache, value_cache, rows.block_ids,
                                        rows.block_starts, rows.context_lens,
                                        rows.sequence_starts, scale_, false);
    const at::Tensor attention = layer.o.forward(out.flatten(1), ops_, panel_rows_);
    h = ops_.add_rms_norm.call(x, attention, layer.post_norm, eps_, dtype);
    // LlamaMLP.forward.
    const at::Tensor act =
        layer.gate_up_silu
            ? ops_.silu_tile_linear->call(h, layer.gate_up.tiles, intermediate_)
            : ops_.silu_mul.call(layer.gate_up.forward(h, ops_, panel_rows_));
    return layer.down.forward(act, ops_, panel_rows_);
  }

  const int64_t hidden_, heads_, kv_heads_, head_dim_, intermediate_;
  const double eps_, scale_;
  const int64_t panel_rows_;
  const at::Tensor embedding_, cos_, signed_sin_, final_norm_;
  Ops ops_;
  std::vector<Layer> layers_;
};

}  // namespace deepwell::dense_decode

namespace deepwell {

void bind_dense_decoder(pybind11::module_& m) {
  using dense_decode::LlamaDenseDecoder;
  pybind11::class_<LlamaDenseDecoder>(m, "LlamaDenseDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, int64_t,
                          at::Tensor, at::Tensor, at::Tensor, at::Tensor>(),
           pybind11::arg("hidden"), pybind11::arg("heads"), pybind11::arg("kv_heads"),
           pybind11::arg("head_dim"), pybind11::arg("intermediate"), pybind11::arg("eps"),
           pybind11::arg("scale"), pybind11::arg("panel_rows"), pybind11::arg("embedding"),
           pybind11::arg("cos"), pybind11::arg("signed_sin"), pybind11::arg("final_norm"))
      .def("add_layer", &LlamaDenseDecoder::add_layer,
           "one decoder layer's norms and linears, each (weight, tiles, packed, panels, bias, "
           "padding), and whether gate_up's tiles give silu_mul's output",
           pybind11::arg("input_norm"), pybind11::arg("post_norm"), pybind11::arg("qkv"),
           pybind11::arg("o"), pybind11::arg("gate_up"), pybind11::arg("down"),
           pybind11::arg("gate_up_silu") = false)
      .def("forward", &LlamaDenseDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "a step of decode rows through every layer: the final-normed hidden state")
      .def_property_readonly("num_layers", &LlamaDenseDecoder::num_layers);
}

}  // namespace deepwell
