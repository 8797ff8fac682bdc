"""Build what the engine core runs on: checkpoint → model → KV plan.

Loads the weights into the registry's model, sizes and allocates the KV cache from the memory
budget, and opens the prefix cache and KV store over it; the core only steps what it is handed.
"""

import logging
import time
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer
from torch import nn

from deepwell.engine.args import EngineArgs
from deepwell.engine.errors import MemoryBudgetError
from deepwell.engine.kv.cache import KVCache, plan_num_blocks
from deepwell.engine.kv.layout import KVLayout
from deepwell.engine.kv.manager import KVCacheManager
from deepwell.engine.kv.prefix import fingerprint
from deepwell.engine.kv.slot_pool import num_slots_for
from deepwell.engine.kv.store_io import open_store
from deepwell.engine.layers.batch_invariant import BatchInvariantAttention, tile_linears
from deepwell.engine.layers.int4_linear import quantize_linears
from deepwell.engine.layers.packed_linear import pack_linears
from deepwell.engine.layers.torch_paged import TorchPagedAttention
from deepwell.engine.models.loader import load_checkpoint
from deepwell.engine.models.registry import ModelOptions, build_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltEngine:
    """A loaded model, its KV cache and what the model brought along."""

    model: nn.Module
    # The model class's own config (e.g. LlamaConfig).
    model_config: Any
    layout: KVLayout
    kv_cache: KVCache
    # Blocks, slots, prefix keys (rooted in the checkpoint's fingerprint) and the KV store.
    kv: KVCacheManager
    tokenizer: Tokenizer | None
    chat_template: str | None
    model_name: str
    architecture: str
    eos_token_ids: frozenset[int]
    # The context limit: the configured one, capped at the model's.
    max_model_len: int
    vocab_size: int


def build_engine(args: EngineArgs) -> BuiltEngine:
    """Load the checkpoint, build its model, plan and allocate its KV cache."""
    started = time.monotonic()
    checkpoint = load_checkpoint(args.model)
    model = build_model(
        checkpoint,
        ModelOptions(
            dtype=args.torch_dtype,
            backend_class=BatchInvariantAttention if args.batch_invariant else TorchPagedAttention,
            quantize_kv_cache=args.quantize_kv_cache,
        ),
    )
    model.load_weights(checkpoint.tensors)
    pack_linears(model)
    # The output head stays bf16: it sets the logits directly, and GGUF files keep it
    # above 4 bits (Q8_0, Q6_K) where the layers are Q4.
    head = getattr(model, "lm_head", None)
    if args.quantization == "int4" and not quantize_linears(model, keep=(head,)):
        raise ValueError("int4 quantization needs bf16 linears packed by oneDNN on this CPU")
    if args.batch_invariant:
        tile_linears(model)
    model.eval()
    max_model_len = min(
        args.max_model_len or model.config.max_position_embeddings,
        model.config.max_position_embeddings,
    )
    layout = model.kv_layout()
    if args.batch_invariant and layout.needs_slots:
        # Rings and state slots are read by the model's own layers, outside these kernels.
        raise ValueError("batch-invariant mode covers models with paged KV only")
    num_slots = num_slots_for(args.max_num_seqs)
    num_blocks = args.num_kv_blocks or plan_num_blocks(
        layout,
        memory_gib=args.memory_gib,
        model_bytes=_model_bytes(model),
        block_size=args.block_size,
        num_slots=num_slots,
        dtype=args.torch_dtype,
        max_model_len=max_model_len,
    )
    if num_blocks * args.block_size < max_model_len:
        raise MemoryBudgetError(
            f"{num_blocks} KV blocks of {args.block_size} tokens cannot hold one "
            f"{max_model_len}-token sequence; raise num_kv_blocks or lower max_model_len"
        )
    kv_cache = KVCache.allocate(layout, num_blocks, args.block_size, num_slots, args.torch_dtype)
    root_key = None
    if args.enable_prefix_caching:
        root_key = fingerprint(
            checkpoint.architecture,
            checkpoint.hf_config,
            checkpoint.tensors,
            layout,
            args.block_size,
            args.torch_dtype,
        )
    store = open_store(args, root_key, kv_cache)
    kv = KVCacheManager(layout, num_blocks, args.block_size, num_slots, root_key, kv_cache, store)
    logger.info(
        "loaded %s (%s, %s) in %.1fs; %d KV blocks of %d tokens",
        checkpoint.path.name,
        checkpoint.architecture,
        args.dtype,
        time.monotonic() - started,
        num_blocks,
        args.block_size,
    )
    return BuiltEngine(
        model=model,
        model_config=model.config,
        layout=layout,
        kv_cache=kv_cache,
        kv=kv,
        tokenizer=checkpoint.tokenizer,
        chat_template=checkpoint.chat_template,
        model_name=checkpoint.name,
        architecture=checkpoint.architecture,
        eos_token_ids=frozenset(model.config.eos_token_ids),
        max_model_len=max_model_len,
        vocab_size=model.config.vocab_size,
    )


def _model_bytes(model: nn.Module) -> int:
    # Buffers count: rotary tables and packed linear weights (layers/packed_linear.py).
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
