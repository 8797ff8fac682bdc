"""The Llama family (Llama 2/3 layouts, SmolLM2): config, layers, weight loading, KV layout.

Qwen2/Qwen3 differ only by switches of the config (qkv bias, per-head q/k norm; qwen.py).

Weights arrive under HF names; q/k/v and gate/up are fused here into single matmuls.

The forward calls its submodules' `forward` directly: `nn.Module.__call__` spends a few µs
per call on hook dispatch, ~270 calls a decode step (0.8 ms of a 48 ms batch-1 bf16 step,
docs/benchmarks.md). So hooks registered on these submodules do not run.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.kv.cache import KVCache
from deepwell.engine.kv.layout import KVLayout, PagedSpec
from deepwell.engine.layers.attention import AttentionBackend, FixedDecodeMetadata
from deepwell.engine.layers.batch_invariant import BatchInvariantAttention
from deepwell.engine.layers.cpp_paged import CppPagedAttention
from deepwell.engine.layers.fused_glue import Glue, KernelGlue, TorchGlue, kernel_glue
from deepwell.engine.layers.norm import RMSNorm
from deepwell.engine.layers.packed_linear import SiluGateUpLinear, fuse_gate_up
from deepwell.engine.layers.rotary import RotaryEmbedding, apply_rotary, fused_rotary
from deepwell.engine.layers.step_metadata import StepMetadata
from deepwell.engine.models.contract import ModelHooks
from deepwell.engine.models.llama_native import native_decode_for
from deepwell.engine.models.skip_init import skip_random_init


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    # Qwen2 adds biases to q/k/v; Qwen3 RMS-normalises each q and k head before rotary.
    attention_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "LlamaConfig":
        # transformers 5 writes `rope_parameters`; released checkpoints a top-level rope_theta.
        rope = hf.get("rope_parameters") or {}
        if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            scaling = hf.get("rope_scaling") or rope
            raise ModelLoadError(f"unsupported rope scaling {scaling!r} for Llama")
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {hf['hidden_act']!r} for Llama")
        eos = hf.get("eos_token_id")
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            attention_bias=hf.get("attention_bias", False),
        )


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, backend: AttentionBackend):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.backend = backend
        # The C++ rotary rides with the C++ and batch-invariant backends, as the fused glue
        # does (its bits are the torch ops', row by row); the torch backend compiles nothing.
        kernel_backends = (CppPagedAttention, BatchInvariantAttention)
        fused = fused_rotary() if isinstance(backend, kernel_backends) else None
        self.rotate = fused or apply_rotary

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], meta, kv_cache):
        qk, v = self.qkv_proj.forward(x).split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            # In float32, as HF's Qwen3RMSNorm computes, whatever the compute dtype.
            q, k = self.q_norm(q.float()), self.k_norm(k.float())
            qk = torch.cat((q, k), dim=1).to(v.dtype)
        # q and k heads share positions, so rotate them in one go.
        qk = self.rotate(qk, *rope)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if isinstance(meta, FixedDecodeMetadata):
            out = self.backend.decode_fixed(q, k, v, *kv_cache, meta)
        else:
            out = self.backend.forward(q, k, v, *kv_cache, meta)
        return self.o_proj.forward(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, glue: Glue) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.glue = glue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if type(gate_up) is SiluGateUpLinear:
            return self.down_proj.forward(gate_up.silu_mul(x))
        return self.down_proj.forward(self.glue.silu_mul(gate_up.forward(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, backend: AttentionBackend, glue: Glue):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, glue)
        self.glue = glue

    def forward(self, x, delta, rope, meta, kv_cache):
        """x: the float32 residual stream; delta: the previous layer's MLP output, not yet
        added (None in the first layer), so that its add and this layer's first norm are one
        pass. Returns the stream and this layer's MLP output."""
        # The residual stream stays float32; only matmul inputs drop to the compute dtype.
        # This keeps bf16 runs close to float32 for the cost of a few elementwise casts.
        dtype = self.mlp.down_proj.weight.dtype
        norm = self.input_layernorm
        x, h = self.glue.add_rms_norm(x, delta, norm.weight, norm.eps, dtype)
        out = self.self_attn.forward(h, rope, meta, kv_cache)
        norm = self.post_attention_layernorm
        x, h = self.glue.add_rms_norm(x, out, norm.weight, norm.eps, dtype)
        return x, self.mlp.forward(h)


class LlamaForCausalLM(nn.Module):
    # A layer's fused projections and the checkpoint tensors whose rows they concatenate, in
    # order: load_weights fuses the float weights so, quant_linear.py the GGUF blocks.
    fused_projections = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    }
    # The native decode step (models/llama_native.py), set by use_native_decode where it
    # applies: the steps it takes skip the layers below.
    native_decode = None

    def __init__(
        self,
        config: LlamaConfig,
        backend_class: type[AttentionBackend],
        dtype: torch.dtype,
        glue: Glue | None = None,
    ):
        super().__init__()
        self.config = config
        self.dtype = dtype
        backend = backend_class(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim
        )
        # Unless a kernel set brings its own (`glue`), the fused glue rides with the C++
        # attention backend (its extension builds it) and the batch-invariant one (the
        # kernel computes each row alone); the torch backend keeps the torch ops.
        if glue is None and issubclass(backend_class, (CppPagedAttention, BatchInvariantAttention)):
            glue = kernel_glue()
        self.glue = glue or TorchGlue
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position_embeddings, dtype
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, self.glue) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> LlamaConfig:
        """The layer switches of this family, from an HF config.json dict."""
        return LlamaConfig.from_hf(hf)

    @classmethod
    def from_checkpoint(cls, checkpoint, options) -> "LlamaForCausalLM":
        config = cls.read_config(checkpoint.hf_config)
        # load_weights sets every parameter: drawing them at random first is time wasted.
        with skip_random_init():
            if options.kernels != "triton":
                return cls(config, options.backend_class, options.dtype)
            if options.batch_invariant:
                raise ValueError(
                    "--kernels triton and batch-invariant mode each choose the kernels: pick one"
                )
            # Imported here: the Triton modules need Triton, which only this kernel set asks.
            from deepwell.engine.layers.triton.paged_attention import TritonPagedAttention
            from deepwell.engine.layers.triton.rms_norm import TritonGlue

            return cls(config, TritonPagedAttention, options.dtype, TritonGlue)

    def kv_layout(self) -> KVLayout:
        c = self.config
        entry = (c.num_key_value_heads, c.head_dim)
        return KVLayout(
            paged=(
                PagedSpec("key", c.num_hidden_layers, entry, entry_axis=1),
                PagedSpec("value", c.num_hidden_layers, entry, entry_axis=1),
            )
        )

    def hooks(self) -> ModelHooks:
        return ModelHooks(
            output_head=self.lm_head,
            fuse_mlp_activation=self.fuse_mlp_activation,
            native_decode=self.use_native_decode,
        )

    def fuse_mlp_activation(self) -> None:
        """Each MLP's silu(gate) * up computed by its gate_up linear where that runs on AMX
        tiles (packed_linear.py, SiluGateUpLinear), whose bits are the fused glue's: with the
        torch glue the MLPs keep their two passes."""
        if self.glue is KernelGlue:
            for layer in self.layers:
                fuse_gate_up(layer.mlp.gate_up_proj)

    def use_native_decode(self, choice: str) -> None:
        """Run small all-decode steps in one C++ call where `choice` ("auto" / "off") and the
        model allow it (llama_native.py)."""
        self.native_decode = native_decode_for(self, choice)

    def forward(self, input_ids, positions, meta: StepMetadata, kv_cache: KVCache):
        if self.native_decode is not None and self.native_decode.takes(input_ids, meta):
            return self.native_decode(input_ids, positions, meta.paged, kv_cache)
        x = self.embed_tokens(input_ids).float()
        rope = self.rotary.lookup(positions)
        caches = zip(kv_cache.paged["key"], kv_cache.paged["value"], strict=True)
        delta = None
        for layer, layer_cache in zip(self.layers, caches, strict=True):
            x, delta = layer.forward(x, delta, rope, meta.paged, layer_cache)
        norm = self.norm
        return self.glue.add_rms_norm(x, delta, norm.weight, norm.eps, torch.float32)[1]

    def compute_logits(
        self, hidden: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The float32 logits of `hidden`'s rows `rows` (every row when None): a bf16 CPU
        head's are its float32 sums (Float32Head), never rounded to bf16."""
        if self.native_decode is not None:
            # A native step with the head inside made this hidden state's logits already.
            logits = self.native_decode.logits_of(hidden)
            if logits is not None:
                return logits if rows is None else logits[rows]
        if rows is not None:
            hidden = hidden[rows]
        head = self.lm_head
        return head(hidden.to(head.weight.dtype)).float()

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be set."""
        fused = {f"{target}.weight": parts for target, parts in self.fused_projections.items()}
        if self.config.attention_bias:
            fused["self_attn.qkv_proj.bias"] = self.fused_projections["self_attn.qkv_proj"]
        params = dict(self.named_parameters())
        unset = set(params)

        def put(name: str, value: torch.Tensor) -> None:
            if name not in params:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
            if params[name].shape != value.shape:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, "
                    f"the model expects {tuple(params[name].shape)}"
                )
            params[name].copy_(value)
            unset.discard(name)

        part_names = {
            f"{part}.{target.rsplit('.', 1)[1]}"
            for target, parts in fused.items()
            for part in parts
        }
        for name, value in tensors.items():
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name.split(".", 2)[-1] not in part_names:
                put(name, value)
        for i in range(self.config.num_hidden_layers):
            prefix = f"layers.{i}."
            for target, parts in fused.items():
                kind = target.rsplit(".", 1)[1]
                pieces = [tensors.get(f"model.{prefix}{p}.{kind}") for p in parts]
                if any(p is None for p in pieces):
                    raise ModelLoadError(f"checkpoint lacks {prefix}{target} pieces {parts}")
                put(prefix + target, torch.cat(pieces, dim=0))
        if unset:
            raise ModelLoadError(f"checkpoint lacks tensors: {sorted(unset)[:5]}")
        # Matmul weights in the compute dtype; norm weights stay float32 (see the layer).
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.to(self.dtype)
