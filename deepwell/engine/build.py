"""Build what the engine core runs on: checkpoint → model → KV plan.

Loads the weights into the registry's model, sizes and allocates the KV cache from the memory
budget, and opens the prefix cache and KV store over it; the core only steps what it is handed.
"""

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import nn

from deepwell.engine.args import EngineArgs
from deepwell.engine.device import HOST, memory_budget_gib, resolve_device
from deepwell.engine.errors import MemoryBudgetError
from deepwell.engine.kv.cache import KVCache, plan_num_blocks
from deepwell.engine.kv.layout import KVLayout
from deepwell.engine.kv.manager import KVCacheManager
from deepwell.engine.kv.prefix import fingerprint
from deepwell.engine.kv.replay import BoundedReplay, TruncationMode
from deepwell.engine.kv.slot_pool import num_slots_for
from deepwell.engine.kv.snapshots import SNAPSHOTS_PER_SLOT, RingSnapshots, snapshot_parts
from deepwell.engine.kv.store_io import open_store
from deepwell.engine.layers.batch_invariant import (
    BatchInvariantAttention,
    BatchInvariantSinkAttention,
    tile_linears,
)
from deepwell.engine.layers.cpp_paged import paged_backend_class
from deepwell.engine.layers.packed_linear import pack_linears
from deepwell.engine.layers.quant_linear import quantize_linears
from deepwell.engine.layers.sink_attention import TorchSinkAttention
from deepwell.engine.layers.torch_paged import TorchPagedAttention
from deepwell.engine.layers.triton import log_kernel_set
from deepwell.engine.models.llama import LlamaForCausalLM
from deepwell.engine.models.llama_native import native_decode_for
from deepwell.engine.models.loader import Checkpoint, load_checkpoint, routed_expert_count
from deepwell.engine.models.registry import ModelOptions, build_model
from deepwell.engine.parallel.expert import ExpertSharding
from deepwell.engine.parallel.group import DistributedGroup
from deepwell.engine.parallel.placement import balanced_placement, check_divisible
from deepwell.engine.plan import refuse_unfit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltEngine:
    """A loaded model, its KV cache and what the model brought along."""

    model: nn.Module
    # The model class's own config (e.g. LlamaConfig).
    model_config: Any
    layout: KVLayout
    # How far the YOCO consumer layers' window reaches (kv/replay.py).
    replay: BoundedReplay
    kv_cache: KVCache
    # Blocks, slots, prefix keys (rooted in the checkpoint's fingerprint) and the KV store.
    kv: KVCacheManager
    tokenizer: Tokenizer | None
    chat_template: str | None
    model_name: str
    architecture: str
    eos_token_ids: frozenset[int]
    # For chat templates that write `bos_token` (the HTTP process renders them).
    bos_token_id: int | None
    # The context limit: the configured one, capped at the model's.
    max_model_len: int
    vocab_size: int
    # The drafter speculation uses ("ngram" or "dspark"); None when it is off.
    speculative_method: str | None = None
    # Where the weights and the KV cache live (`--device`).
    device: torch.device = HOST


@dataclass(frozen=True)
class LoadedModel:
    """A checkpoint's model with its weights in, ready to compute (no KV cache yet)."""

    model: nn.Module
    checkpoint: Checkpoint
    # The drafter speculation uses ("ngram" or "dspark"); None when it is off.
    speculative_method: str | None
    # This rank's share of the routed experts under expert parallelism; None holds them all.
    experts: ExpertSharding | None = None


def load_model(args: EngineArgs, group: DistributedGroup | None = None) -> LoadedModel:
    """Load the checkpoint into its model, packed and quantised as `args` ask: what every
    rank of a parallel group computes with (parallel/). With `group` (expert parallelism)
    this rank loads and holds only its share of the routed experts."""
    device = resolve_device(args.device)
    experts = _expert_sharding(args, group)
    if experts is None and args.num_kv_blocks is None:
        # Before any weight is read: a model that cannot fit is refused in seconds, with
        # the plan's reason (engine/plan/). A rank holds only its share of the experts, and
        # a fixed block count sets the budget aside, so neither is planned here.
        refuse_unfit(
            args.model,
            memory_budget_gib(args.memory_gib, args.gpu_memory_utilization, device),
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            block_size=args.block_size,
            compute_dtype=args.dtype_choice.dtype,
        )
    log_kernel_set(args.kernels, device.type)
    checkpoint = load_checkpoint(args.model, None if experts is None else experts.holds)
    method = _speculative_method(args, checkpoint.tensors)
    model = build_model(
        checkpoint,
        ModelOptions(
            dtype=args.torch_dtype,
            backend_class=(
                BatchInvariantAttention
                if args.batch_invariant
                # The C++ kernels read host memory only.
                else paged_backend_class(args.attention_backend)
                if device.type == "cpu"
                else TorchPagedAttention
            ),
            sink_backend_class=(
                BatchInvariantSinkAttention if args.batch_invariant else TorchSinkAttention
            ),
            quantize_kv_cache=args.quantize_kv_cache,
            expand_weights=args.expand_weights,
            dspark=method == "dspark",
            batch_invariant=args.batch_invariant,
            experts=experts,
            kernels=args.kernels,
        ),
    )
    model.load_weights(checkpoint.tensors)
    if device != HOST:
        # Before the CPU-only packing and quantisation below, which leave device weights alone.
        model.to(device)
    pack_linears(model)
    # The output head takes 8 bits (Q8_0), the layers 4 (Q4_1): the head sets the logits
    # directly, and GGUF files keep it above 4 bits too.
    head = getattr(model, "lm_head", None)
    if args.quantization == "int4" and not quantize_linears(model, head, checkpoint.blocks):
        raise ValueError("int4 quantization found no linear whose inputs come in blocks of 32")
    if args.batch_invariant:
        tile_linears(model)
    elif isinstance(model, LlamaForCausalLM):
        model.native_decode = native_decode_for(model, args.native_decode)
    model.eval()
    return LoadedModel(model, checkpoint, method, experts)


def build_engine(args: EngineArgs, group: DistributedGroup | None = None) -> BuiltEngine:
    """Load the checkpoint, build its model, plan and allocate its KV cache (`group`: see
    load_model)."""
    started = time.monotonic()
    loaded = load_model(args, group)
    model, checkpoint, method = loaded.model, loaded.checkpoint, loaded.speculative_method
    experts = loaded.experts
    device = resolve_device(args.device)
    max_model_len = min(
        args.max_model_len or model.config.max_position_embeddings,
        model.config.max_position_embeddings,
    )
    layout = model.kv_layout()
    if args.batch_invariant and layout.needs_slots and not getattr(model, "invariant_rings", False):
        # Rings and state slots are read by the model's own layers, outside these kernels:
        # only a model that declares invariant paths for them (DeepSeek-V4.1) runs here.
        raise ValueError(
            "batch-invariant mode covers models with paged KV, and ring models with "
            "batch-invariant ring layers (DeepSeek-V4.1), only"
        )
    num_slots = num_slots_for(args.max_num_seqs)
    replay = BoundedReplay(
        TruncationMode(args.yoco_prefill_truncation_mode), args.yoco_prefill_keep_tokens
    )
    replay.check(layout)
    snapshots = None
    if args.enable_prefix_caching and layout.ring_snapshots:
        layout = layout.with_snapshot_rows(args.block_size)
        parts = snapshot_parts(layout, replay, args.block_size, args.torch_dtype)
        snapshots = RingSnapshots(parts, SNAPSHOTS_PER_SLOT * num_slots)
    num_blocks = args.num_kv_blocks or plan_num_blocks(
        layout,
        memory_gib=memory_budget_gib(args.memory_gib, args.gpu_memory_utilization, device),
        model_bytes=_model_bytes(model),
        block_size=args.block_size,
        num_slots=num_slots,
        dtype=args.torch_dtype,
        max_model_len=max_model_len,
        reserved_bytes=0 if snapshots is None else snapshots.capacity * snapshots.snapshot_bytes,
    )
    if num_blocks * args.block_size < max_model_len:
        raise MemoryBudgetError(
            f"{num_blocks} KV blocks of {args.block_size} tokens cannot hold one "
            f"{max_model_len}-token sequence; raise num_kv_blocks or lower max_model_len"
        )
    kv_cache = KVCache.allocate(
        layout, num_blocks, args.block_size, num_slots, args.torch_dtype, device
    )
    root_key = None
    if args.enable_prefix_caching:
        # Expert-parallel ranks hold different experts but serve one model: its fingerprint
        # (which workers compare) leaves the routed experts out.
        tensors = checkpoint.tensors
        if experts is not None:
            tensors = {name: t for name, t in tensors.items() if ".ffn.experts." not in name}
        root_key = fingerprint(
            checkpoint.architecture,
            checkpoint.hf_config,
            tensors,
            layout,
            args.block_size,
            args.torch_dtype,
        )
    parts = None if snapshots is None else snapshots.parts
    store = open_store(args, root_key, kv_cache, parts)
    kv = KVCacheManager(
        layout,
        num_blocks,
        args.block_size,
        num_slots,
        root_key,
        kv_cache,
        store,
        replay,
        snapshots,
    )
    logger.info(
        "loaded %s (%s, %s) in %.1fs; %d KV blocks of %d tokens",
        checkpoint.path.name,
        checkpoint.architecture,
        args.dtype_choice.dtype,
        time.monotonic() - started,
        num_blocks,
        args.block_size,
    )
    return BuiltEngine(
        model=model,
        model_config=model.config,
        layout=layout,
        replay=replay,
        kv_cache=kv_cache,
        kv=kv,
        tokenizer=checkpoint.tokenizer,
        chat_template=checkpoint.chat_template,
        model_name=checkpoint.name,
        architecture=checkpoint.architecture,
        eos_token_ids=frozenset(model.config.eos_token_ids),
        bos_token_id=checkpoint.hf_config.get("bos_token_id"),
        max_model_len=max_model_len,
        vocab_size=model.config.vocab_size,
        speculative_method=method,
        device=device,
    )


def check_expert_parallel(args: EngineArgs) -> int:
    """The model's routed experts per layer, if `args.parallel` can shard them (raises
    otherwise): checked before a rank joins its group, where a refusal would leave the
    other ranks waiting."""
    num_experts = routed_expert_count(args.model)
    parallel = args.parallel
    check_divisible(num_experts, parallel.world_size, parallel.eplb_redundant_experts)
    return num_experts


def _expert_sharding(args: EngineArgs, group: DistributedGroup | None) -> ExpertSharding | None:
    """The placement every MoE layer starts from: uniform (EPLB has seen no load yet)."""
    if group is None:
        return None
    num_experts = check_expert_parallel(args)
    slots = num_experts + args.parallel.eplb_redundant_experts
    return ExpertSharding(group, balanced_placement([1.0] * num_experts, group.world_size, slots))


def _speculative_method(args: EngineArgs, tensors: dict[str, Any]) -> str | None:
    """The drafter: the one asked for, else DSpark where the checkpoint has draft stages."""
    if not args.num_speculative_tokens:
        return None
    has_stages = any(name.startswith("mtp.") for name in tensors)
    if args.speculative_method == "dspark" and not has_stages:
        raise ValueError(
            "speculative_method 'dspark' needs a DeepSeek-V4.1 checkpoint with its draft "
            "stages (mtp.*); use 'ngram'"
        )
    return args.speculative_method or ("dspark" if has_stages else "ngram")


def _model_bytes(model: nn.Module) -> int:
    # Buffers count: rotary tables and packed linear weights (layers/packed_linear.py).
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
