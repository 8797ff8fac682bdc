"""Build what the engine core runs on: checkpoint → model → KV plan.

Loads the weights into the registry's model, sizes and allocates the KV cache from the memory
budget, and opens the prefix cache and KV store over it; the core only steps what it is handed.
"""

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

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
from deepwell.engine.layers.float32_head import can_take_float32_head, to_float32_head
from deepwell.engine.layers.float32_linear import pad_small_calls
from deepwell.engine.layers.forced_routing import ForcedRouting
from deepwell.engine.layers.packed_linear import pack_linears
from deepwell.engine.layers.quant_linear import quantize_linears
from deepwell.engine.layers.sink_attention import TorchSinkAttention
from deepwell.engine.layers.torch_paged import TorchPagedAttention
from deepwell.engine.layers.triton import log_kernel_set
from deepwell.engine.models.contract import CausalLM
from deepwell.engine.models.loader import Checkpoint, load_checkpoint, routed_expert_count
from deepwell.engine.models.registry import (
    ModelOptions,
    build_model,
    dummy_checkpoint,
    model_entry,
)
from deepwell.engine.parallel.expert import ExpertSharding
from deepwell.engine.parallel.group import DistributedGroup
from deepwell.engine.parallel.placement import balanced_placement, check_divisible
from deepwell.engine.plan import refuse_unfit
from deepwell.engine.start_log import phase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltEngine:
    """A loaded model, its KV cache and what the model brought along."""

    model: CausalLM
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

    model: CausalLM
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
    with phase(f"reading the checkpoint {args.model or 'embedded SmolLM2-135M-Instruct'}"):
        checkpoint = _checkpoint(args, experts)
    method = _speculative_method(args, checkpoint)
    with phase("building the model and binding its weights"):
        model = build_model(checkpoint, _model_options(args, method, experts, device))
        model.load_weights(checkpoint.tensors)
    if device != HOST:
        # Before the CPU-only packing and quantisation below, which leave device weights alone.
        model.to(device)
    with phase("packing the linears (and quantising them, with --quantization int4)"):
        pack_linears(model)
        hooks = model.hooks()
        # The output head takes 8 bits (Q8_0), the layers 4 (Q4_1): the head sets the logits
        # directly, and GGUF files keep it above 4 bits too.
        if args.quantization == "int4" and not quantize_linears(
            model, hooks.output_head, checkpoint.blocks
        ):
            raise ValueError("int4 quantization found no linear whose inputs come in blocks of 32")
        if hooks.output_head is not None and can_take_float32_head(hooks.output_head):
            # After int4, whose blocks it keeps; batch invariant in every mode.
            to_float32_head(hooks.output_head)
    if args.batch_invariant:
        tile_linears(model)
    else:
        # After int4, which takes plain linears; the batch-invariant mode has its own calls.
        pad_small_calls(model)
        if hooks.fuse_mlp_activation is not None:
            hooks.fuse_mlp_activation()
    if hooks.native_decode is not None:
        # After tile_linears and pad_small_calls: the batch-invariant mode keeps its own path
        # (the model's start-up log says so), and the native step pads as the linears do.
        hooks.native_decode(args.native_decode)
    model.eval()
    return LoadedModel(model, checkpoint, method, experts)


def _checkpoint(args: EngineArgs, experts: ExpertSharding | None) -> Checkpoint:
    """The checkpoint's tensors as stored, or (load_format "dummy") drawn at random in their
    shapes and encodings from config.json alone."""
    if args.load_format == "dummy":
        if experts is not None:
            raise ValueError("load_format 'dummy' does not combine with expert parallelism")
        return dummy_checkpoint(args.model or "", args.seed)
    return load_checkpoint(args.model, None if experts is None else experts.holds)


def _model_options(
    args: EngineArgs, method: str | None, experts: ExpertSharding | None, device: torch.device
) -> ModelOptions:
    return ModelOptions(
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
        forced_routing=forced_routing(args),
    )


def forced_routing(args: EngineArgs) -> ForcedRouting | None:
    """The MoE routing override the DEEPWELL_FORCE_* switches ask for, if any."""
    if args.force_imbalance_ratio:
        return ForcedRouting(args.force_imbalance_ratio)
    return ForcedRouting() if args.force_load_balance else None


def build_engine(args: EngineArgs, group: DistributedGroup | None = None) -> BuiltEngine:
    """Load the checkpoint, build its model, plan and allocate its KV cache (`group`: see
    load_model)."""
    started = time.monotonic()
    if args.kv_store_path is not None:
        # Before the weights: an unusable store directory stops the start at once, not after
        # a load that takes seconds to minutes (the store opens it again below).
        Path(args.kv_store_path).mkdir(parents=True, exist_ok=True)
    loaded = load_model(args, group)
    model, checkpoint = loaded.model, loaded.checkpoint
    device = resolve_device(args.device)
    max_model_len = min(
        args.max_model_len or model.config.max_position_embeddings,
        model.config.max_position_embeddings,
    )
    layout = model.kv_layout().with_max_backtrack(args.max_backtracking_tokens)
    if args.batch_invariant and layout.needs_slots and not model.hooks().invariant_rings:
        # Rings and state slots are read by the model's own layers, outside these kernels:
        # only a model that declares invariant paths for them (DeepSeek-V4.1) runs here.
        raise ValueError(
            "batch-invariant mode covers models with paged KV, and ring models with "
            "batch-invariant ring layers (DeepSeek-V4.1), only"
        )
    replay = BoundedReplay(
        TruncationMode(args.yoco_prefill_truncation_mode), args.yoco_prefill_keep_tokens
    )
    replay.check(layout)
    with phase("planning and allocating the KV pool"):
        kv = _kv_cache_manager(args, loaded, layout, replay, max_model_len, device)
    logger.info(
        "loaded %s (%s, %s) in %.1fs; %d KV blocks of %d tokens",
        checkpoint.path.name,
        checkpoint.architecture,
        args.dtype_choice.dtype,
        time.monotonic() - started,
        kv.block_pool.num_blocks,
        args.block_size,
    )
    return BuiltEngine(
        model=model,
        model_config=model.config,
        layout=kv.layout,
        replay=replay,
        kv_cache=kv.cache,
        kv=kv,
        tokenizer=checkpoint.tokenizer,
        chat_template=checkpoint.chat_template,
        model_name=checkpoint.name,
        architecture=checkpoint.architecture,
        eos_token_ids=frozenset(model.config.eos_token_ids),
        bos_token_id=checkpoint.hf_config.get("bos_token_id"),
        max_model_len=max_model_len,
        vocab_size=model.config.vocab_size,
        speculative_method=loaded.speculative_method,
        device=device,
    )


def _kv_cache_manager(
    args: EngineArgs,
    loaded: LoadedModel,
    layout: KVLayout,
    replay: BoundedReplay,
    max_model_len: int,
    device: torch.device,
) -> KVCacheManager:
    """The KV cache sized from the memory budget, with its snapshots, prefix keys and store."""
    num_slots = num_slots_for(args.max_num_seqs, args.num_state_slots_ratio)
    snapshots = None
    if args.enable_prefix_caching and layout.ring_snapshots:
        layout = layout.with_snapshot_rows(args.block_size)
        parts = snapshot_parts(layout, replay, args.block_size, args.torch_dtype)
        snapshots = RingSnapshots(parts, SNAPSHOTS_PER_SLOT * num_slots)
    num_blocks = args.num_kv_blocks or plan_num_blocks(
        layout,
        memory_gib=memory_budget_gib(args.memory_gib, args.gpu_memory_utilization, device),
        model_bytes=_model_bytes(loaded.model),
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
    root_key = _root_key(args, loaded, layout) if args.enable_prefix_caching else None
    parts = None if snapshots is None else snapshots.parts
    store = open_store(args, root_key, kv_cache, parts)
    return KVCacheManager(
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


def _root_key(args: EngineArgs, loaded: LoadedModel, layout: KVLayout) -> bytes:
    """The prefix chain's root: the model's fingerprint, which workers compare."""
    checkpoint = loaded.checkpoint
    tensors = checkpoint.tensors
    if loaded.experts is not None:
        # Expert-parallel ranks hold different experts but serve one model: its fingerprint
        # leaves the routed experts out.
        is_expert = loaded.model.hooks().routed_experts.is_expert_tensor
        tensors = {name: t for name, t in tensors.items() if not is_expert(name)}
    return fingerprint(
        checkpoint.architecture,
        checkpoint.hf_config,
        tensors,
        layout,
        args.block_size,
        args.torch_dtype,
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


def _speculative_method(args: EngineArgs, checkpoint: Checkpoint) -> str | None:
    """The drafter: the one asked for, else DSpark where the checkpoint has draft stages."""
    if not args.num_speculative_tokens:
        return None
    has_stages = model_entry(checkpoint.architecture).has_draft_stages(checkpoint)
    if args.speculative_method == "dspark" and not has_stages:
        raise ValueError(
            "speculative_method 'dspark' needs a DeepSeek-V4.1 checkpoint with its draft "
            "stages (mtp.*); use 'ngram'"
        )
    return args.speculative_method or ("dspark" if has_stages else "ngram")


def _model_bytes(model: CausalLM) -> int:
    # Buffers count: rotary tables and packed linear weights (layers/packed_linear.py).
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
