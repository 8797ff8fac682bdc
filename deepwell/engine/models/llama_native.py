"""The native decode step of the Llama family: every layer of an all-decode step in one C++
call, and which models and steps it takes.

A model qualifies with decode attention on the C++ kernel and no per-head q/k norm (Qwen3),
and either of two decoders:
- its layer linears on GGUF blocks (`--quantization int4`): layers/llama_decode.cpp runs its
  own kernels on steps up to the linears' cut-over to dense weights, its head inside the step
  too where it is on GGUF blocks (the logits handed to compute_logits);
- its layer linears dense (bf16 PackedLinear, float32 nn.Linear or RowPaddedLinear) with the fused glue and
  rotary: layers/llama_dense_decode.cpp calls the very kernels the layers below call, in
  their order, so its hidden state is theirs bit for bit; it takes steps of any row count
  and leaves the head to compute_logits.
A step qualifies when all its rows are decode rows (and, for the first, no more than the
cut-over). Any other step runs the model's torch path.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from deepwell.engine.kv.cache import KVCache
from deepwell.engine.layers.attention import AttentionMetadata
from deepwell.engine.layers.batch_invariant import AmxTileLinear, BatchInvariantAttention
from deepwell.engine.layers.bf16_gemm import MAX_ROWS as PANEL_ROWS
from deepwell.engine.layers.cpp_paged import CppPagedAttention
from deepwell.engine.layers.decode_kernel import load_llama_kernel
from deepwell.engine.layers.float32_head import Float32Head
from deepwell.engine.layers.float32_linear import GEMM_ROWS, MIN_PADDED_ROWS, RowPaddedLinear
from deepwell.engine.layers.fused_glue import KernelGlue
from deepwell.engine.layers.packed_linear import PackedLinear, SiluGateUpLinear
from deepwell.engine.layers.quant_linear import QuantDecodeLinear
from deepwell.engine.layers.rotary import RotaryEmbedding, apply_rotary
from deepwell.engine.layers.step_metadata import StepMetadata

if TYPE_CHECKING:
    # llama.py builds its native step from here.
    from deepwell.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def step_arguments(
    input_ids: torch.Tensor, positions: torch.Tensor, paged: AttentionMetadata, kv_cache: KVCache
) -> tuple:
    """What both C++ decoders' `forward` take first: the step's rows, the caches, where each
    row's K/V goes and which blocks it reads."""
    lists = paged.row_block_lists
    return (
        input_ids,
        positions,
        kv_cache.paged["key"],
        kv_cache.paged["value"],
        paged.slot_blocks,
        paged.slot_offsets,
        *(
            (paged.decode_block_ids, paged.decode_block_starts, paged.decode_context_len_tensor)
            if lists is None
            else (lists.block_ids, lists.block_starts, lists.context_lens)
        ),
    )


def sequence_starts(paged: AttentionMetadata) -> torch.Tensor:
    """Where each sequence's rows begin: a draft's verify rows read its blocks together."""
    lists = paged.row_block_lists
    return paged.decode_sequence_starts if lists is None else lists.sequence_starts


class NativeDecode:
    """The model's C++ decoder (its weights referenced, not copied) and its row limit; with
    the head inside, the logits of its last step, for compute_logits to hand back."""

    def __init__(self, decoder, max_rows: int) -> None:
        self.decoder = decoder
        self.max_rows = max_rows
        # (hidden, logits) of the last step, until compute_logits takes them.
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def takes(self, input_ids: torch.Tensor, meta: StepMetadata) -> bool:
        paged = meta.paged
        rows = input_ids.shape[0]
        # A decode-graph step (FixedDecodeMetadata) runs the layers: its shapes are the graph's.
        if not isinstance(paged, AttentionMetadata) or not 0 < rows <= self.max_rows:
            return False
        if paged.row_block_lists is not None:
            # The batch-invariant layout: each row over its own blocks, prefill or decode, in
            # the kernel the layers call; a step whose rows are each their own sequence's
            # (no prompt chunk, no draft) is all decodes.
            return len(paged.row_block_lists.sequence_starts) == rows + 1
        return not paged.prefills and paged.num_decodes == rows

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        paged: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """The final-normed hidden state [rows, hidden], float32."""
        hidden, logits = self.decoder.forward(
            *step_arguments(input_ids, positions, paged, kv_cache)
        )
        self._last = None if logits is None else (hidden, logits)
        return hidden

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits of the last step's rows if `hidden` is that step's hidden state (the
        very tensor it returned), else None; either way they are handed out once."""
        last, self._last = self._last, None
        if last is None or last[0] is not hidden:
            return None
        return last[1]


class DenseNativeDecode(NativeDecode):
    """The C++ decoder of dense weights: steps of any number of decode rows, the hidden state
    only (compute_logits runs the head)."""

    def __init__(self, decoder) -> None:
        super().__init__(decoder, sys.maxsize)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        paged: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """The final-normed hidden state [rows, hidden], float32."""
        arguments = step_arguments(input_ids, positions, paged, kv_cache)
        return self.decoder.forward(*arguments, sequence_starts(paged))


def native_decode_for(model: LlamaForCausalLM, choice: str) -> NativeDecode | None:
    """The native step for `model` where `choice` (EngineArgs.native_decode: "auto" / "off")
    and the model allow it, else None; the start-up log says which path decodes and why."""
    if choice == "off":
        logger.info("decode step: torch path (--native-decode off)")
        return None
    reason = _unsupported(model)
    if reason is None:
        kernel = load_llama_kernel()
        if kernel.module is None:
            reason = f"its kernel is unavailable: {kernel.reason}"
    if reason is not None:
        logger.info("decode step: torch path, the native step does not apply: %s", reason)
        return None
    if _on_blocks(model):
        native = build_native_decode(model, kernel.module)
        logger.info(
            "decode step: native (all layers in one C++ call) for steps of up to %d decode "
            "rows on GGUF blocks",
            native.max_rows,
        )
        return native
    logger.info(
        "decode step: native (all layers in one C++ call) for decode steps of any row count "
        "on dense weights"
    )
    return build_dense_native_decode(model, kernel.module)


def _unsupported(model: LlamaForCausalLM) -> str | None:
    config = model.config
    if config.qk_norm:
        return "per-head q/k norm (Qwen3)"
    layer = model.layers[0]
    invariant = isinstance(layer.self_attn.backend, BatchInvariantAttention)
    if not invariant and not isinstance(layer.self_attn.backend, CppPagedAttention):
        return "decode attention is not on the C++ kernel"
    if layer.self_attn.backend.kernel is None:
        return "the C++ attention kernel did not load"
    if _on_blocks(model):
        return "the batch-invariant mode's own path on GGUF blocks" if invariant else None
    if model.embed_tokens.weight.device.type != "cpu":
        return "the model is not on the CPU, where the C++ kernels run"
    linears = [m for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    if invariant:
        # Its layers compute each row alone; the step calls the same kernels, the linears'
        # where they are AMX tiles (the row-wise ones have no op the step could call).
        if not all(type(m) is AmxTileLinear for m in linears):
            return "the batch-invariant linears are not on AMX tiles"
    elif not all(type(m) in DENSE_LINEARS for m in linears):
        return "the layer linears are neither all on GGUF blocks nor all dense"
    # The dense decoder calls the layers' fused kernels: where they fell back to torch ops,
    # only the layers compute the same bits.
    if model.glue is not KernelGlue:
        return "the layers' glue is not the fused C++ kernel"
    if layer.self_attn.rotate is apply_rotary:
        return "the layers' rotary is not the fused C++ kernel"
    return None


# What the dense native step calls as the layers do (a SiluGateUpLinear by its silu_mul).
DENSE_LINEARS = (PackedLinear, SiluGateUpLinear, RowPaddedLinear, torch.nn.Linear)


def _on_blocks(model: LlamaForCausalLM) -> bool:
    """Whether the layer linears are on GGUF blocks (`--quantization int4`)."""
    linears = [m for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    return all(type(m) is QuantDecodeLinear for m in linears)


@torch.no_grad()
def build_native_decode(model: LlamaForCausalLM, kernel: ModuleType) -> NativeDecode:
    """The C++ decoder over the model's own tensors (after build.py quantised them)."""
    config = model.config
    # float32 tables whatever the engine's dtype: the native step is float32 between linears.
    rotary = RotaryEmbedding(
        config.head_dim, config.rope_theta, config.max_position_embeddings, torch.float32
    )
    decoder = kernel.LlamaDecoder(
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate=config.intermediate_size,
        eps=config.rms_norm_eps,
        embedding=model.embed_tokens.weight.detach().contiguous(),
        cos=rotary.cos,
        signed_sin=rotary.signed_sin,
        final_norm=model.norm.weight.detach().float(),
    )
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        bias = attention.qkv_proj.bias
        decoder.add_layer(
            layer.input_layernorm.weight.detach().float(),
            layer.post_attention_layernorm.weight.detach().float(),
            _blocks(attention.qkv_proj),
            None if bias is None else bias.detach().float(),
            _blocks(attention.o_proj),
            _blocks(mlp.gate_up_proj),
            _blocks(mlp.down_proj),
        )
    linears = [m for m in model.layers.modules() if isinstance(m, QuantDecodeLinear)]
    head = model.lm_head
    # A head without GGUF blocks stays in Python, in compute_logits.
    if getattr(head, "quant_weight", None) is not None:
        decoder.set_head(_blocks(head), head.out_features, head.weight.dtype == torch.bfloat16)
        linears.append(head)
    return NativeDecode(decoder, min([kernel.max_rows, *(m.max_rows for m in linears)]))


@torch.no_grad()
def build_dense_native_decode(model: LlamaForCausalLM, kernel: ModuleType) -> DenseNativeDecode:
    """The C++ decoder of dense weights over the model's own tensors (after build.py packed
    them), with the layers' norms, rotary tables and attention scale."""
    config, layer = model.config, model.layers[0]
    decoder = kernel.LlamaDenseDecoder(
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate=config.intermediate_size,
        eps=model.norm.eps,
        scale=layer.self_attn.backend.scale,
        panel_rows=PANEL_ROWS,
        embedding=model.embed_tokens.weight.detach(),
        cos=model.rotary.cos,
        signed_sin=model.rotary.signed_sin,
        final_norm=model.norm.weight.detach(),
    )
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        decoder.add_layer(
            layer.input_layernorm.weight.detach(),
            layer.post_attention_layernorm.weight.detach(),
            _dense(attention.qkv_proj),
            _dense(attention.o_proj),
            _dense(mlp.gate_up_proj),
            _dense(mlp.down_proj),
            gate_up_silu=type(mlp.gate_up_proj) is SiluGateUpLinear,
        )
    return DenseNativeDecode(decoder)


def _dense(linear: torch.nn.Linear) -> tuple:
    """(weight, the AMX tiles, oneDNN's packed weight, the panels, bias, the rows it pads from
    and to), None where the linear has none, (0, 0) where it pads none."""
    bias = None if linear.bias is None else linear.bias.detach()
    if type(linear) in (AmxTileLinear, PackedLinear, SiluGateUpLinear):
        parts = (getattr(linear, name, None) for name in ("tiles", "packed_weight", "panels"))
        return linear.weight.detach(), *parts, bias, (0, 0)
    padding = (MIN_PADDED_ROWS, GEMM_ROWS) if type(linear) is RowPaddedLinear else (0, 0)
    return linear.weight.detach(), None, None, None, bias, padding


def _blocks(linear: QuantDecodeLinear | Float32Head) -> tuple[str, torch.Tensor]:
    return linear.kind, linear.quant_weight
