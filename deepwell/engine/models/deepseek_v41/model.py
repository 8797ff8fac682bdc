"""DeepSeek-V4.1 for the engine: blocks of CSA2 attention and MoE on a 4-stream mHC
residual, Engram memory reads, and the KV layout holding all per-sequence state.

Every cache lives in the engine's layout (spec/deepseek_v41.md §4): the window rows of every
layer and the ratio-2 compressor tails in per-sequence rings, the compressed entries and
index keys of the KV sources in the shared paged blocks. Chunked prefill, decode and mixed
batches therefore run as they do for Llama. The layers from the first ratio-1 layer on are
YOCO consumers: in a bounded-replay mode (kv/replay.py) their window stops at the request's
replay start, and in compact mode they run only the rows from there. With DSpark on, the
target also fills the draft stages' context rings from its `dspark_target_layer_ids`
layers (dspark.py).
"""

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.kv.cache import KVCache
from deepwell.engine.kv.layout import CacheRole, KVLayout, PagedSpec, RingSpec
from deepwell.engine.layers.batch_invariant import ROW_TILE, row_kernels
from deepwell.engine.layers.sink_attention import SinkAttentionBackend, TorchSinkAttention
from deepwell.engine.layers.step_metadata import StepImages, StepMetadata
from deepwell.engine.models.contract import ModelHooks, RoutedExperts
from deepwell.engine.models.deepseek_v41.attention import (
    CompressedCaches,
    Norm,
    SharedSelection,
)
from deepwell.engine.models.deepseek_v41.binding import bind_weights
from deepwell.engine.models.deepseek_v41.block import DeepseekV41Block
from deepwell.engine.models.deepseek_v41.cache_storage import CacheStorage
from deepwell.engine.models.deepseek_v41.config import (
    MAX_BACKTRACK,
    DeepseekV41Config,
    LayerPlan,
    Selection,
)
from deepwell.engine.models.deepseek_v41.context_parallel_model import V41ContextParallel
from deepwell.engine.models.deepseek_v41.dspark import DSPARK_RING, DSpark
from deepwell.engine.models.deepseek_v41.engram_hash import (
    EngramHashConfig,
    EngramTables,
    build_engram_tables,
    ngram_rows,
)
from deepwell.engine.models.deepseek_v41.kernel_set import (
    TRITON,
    sink_backend_class,
    use_triton_kernels,
)
from deepwell.engine.models.deepseek_v41.mhc import collapse, native_ops
from deepwell.engine.models.deepseek_v41.moe import MoE, moe_graph_blocker
from deepwell.engine.models.deepseek_v41.rotary import PairRotary, native_rotation
from deepwell.engine.models.deepseek_v41.schema import (
    TensorSpec,
    is_draft_stage,
    is_routed_expert,
    tensor_schema,
)
from deepwell.engine.models.deepseek_v41.vision import ImageEncoder, VisionConfig
from deepwell.engine.models.skip_init import skip_random_init
from deepwell.engine.parallel.expert import ExpertParallel, ExpertSharding


class DeepseekV41ForCausalLM(nn.Module):
    config_class = DeepseekV41Config

    def __init__(
        self,
        config: DeepseekV41Config,
        dtype: torch.dtype,
        engram_tables: EngramTables | None = None,
        backend_class: type[SinkAttentionBackend] = TorchSinkAttention,
        dspark: bool = False,
        batch_invariant: bool = False,
        experts: ExpertSharding | None = None,
        vision: VisionConfig | None = None,
        image_token_id: int = -1,
    ) -> None:
        """`experts`: shard the backbone's routed experts over expert-parallel ranks;
        `vision`: the vision tower (None: text only), whose images fill `image_token_id`s."""
        super().__init__()
        self.config = config
        self.expert_sharding = experts
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.plans = config.layer_plans()
        if any(p.engram_slot >= 0 for p in self.plans) and engram_tables is None:
            raise ModelLoadError("DeepSeek-V4.1's Engram layers need the tokenizer's hash tables")
        self.engram_tables = engram_tables
        rope_dim = config.qk_rope_head_dim
        self.plain_rotary = PairRotary(rope_dim, config.rope_theta, None)
        self.compress_rotary = PairRotary(rope_dim, config.compress_rope_theta, config.rope_scaling)
        backend = backend_class(
            config.num_attention_heads, config.head_dim, config.sliding_window, config.index_topk
        )
        parallels = [
            None if experts is None else ExpertParallel(experts.group, experts.placement)
            for _ in self.plans
        ]
        dspark_targets = list(config.dspark_target_layer_ids)
        if dspark:
            if not config.num_nextn_predict_layers:
                raise ModelLoadError("DSpark drafting needs the checkpoint's draft stages (mtp.*)")
            # Their features concatenate in layer order, as the forward meets them.
            increasing = bool(dspark_targets) and dspark_targets == sorted(set(dspark_targets))
            if not increasing or dspark_targets[0] < 0 or dspark_targets[-1] >= len(self.plans):
                raise ModelLoadError(
                    f"dspark_target_layer_ids {dspark_targets} must be increasing backbone layers"
                )
        # Parameters on the meta device, undrawn (skip_init.py): the checkpoint's tensors are
        # bound in their place (load_weights), so building the model allocates no weights.
        with torch.device("meta"), skip_random_init():
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(
                DeepseekV41Block(
                    config,
                    plan,
                    self.compress_rotary if plan.compress_ratio else self.plain_rotary,
                    backend,
                    batch_invariant,
                    parallel=parallel,
                )
                for plan, parallel in zip(self.plans, parallels, strict=True)
            )
            self.norm = Norm(config.hidden_size, config.rms_norm_eps)
            self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.dspark = (
                DSpark(config, self.plain_rotary, backend, batch_invariant) if dspark else None
            )
            self.image_encoder = (
                None
                if vision is None
                else ImageEncoder(vision, config.hidden_size, image_token_id, dtype)
            )
        sources = config.kv_sources
        # Layer → (ratio, index of its KV source among that ratio's sources).
        self._source_slots = {
            plan.index: (plan.compress_ratio, sources[plan.compress_ratio].index(plan.kv_source))
            for plan in self.plans
            if plan.compress_ratio
        }
        self.yoco_boundary = _yoco_boundary(self.plans)
        # Set by from_checkpoint: the released tensors, how to bind them, the kernel set.
        self.tensor_schema: dict[str, TensorSpec] = {}
        self.expand_weights = False
        self.kernels = "auto"

    @classmethod
    def from_checkpoint(cls, checkpoint, options) -> "DeepseekV41ForCausalLM":
        text_config = checkpoint.hf_config.get("text_config") or checkpoint.hf_config
        config = dataclasses.replace(
            DeepseekV41Config.from_hf(checkpoint.hf_config), cache_qdq=options.quantize_kv_cache
        )
        tables = None
        if config.engram_layer_ids:
            if checkpoint.tokenizer is None:
                raise ModelLoadError(
                    f"{checkpoint.path}: DeepSeek-V4.1's Engram hashes tokens through the "
                    "tokenizer; put its tokenizer.json beside the weights"
                )
            try:
                tables = build_engram_tables(
                    checkpoint.tokenizer,
                    EngramHashConfig.from_text_config(text_config),
                    compressed_vocab_size=config.engram_compressed_vocab_size,
                    num_embeddings=config.engram_num_embeddings,
                )
            except ValueError as error:
                raise ModelLoadError(f"{checkpoint.path}: {error}") from None
        model = cls(
            config,
            options.dtype,
            tables,
            sink_backend_class(
                options.kernels, options.sink_backend_class, options.batch_invariant
            ),
            dspark=options.dspark,
            batch_invariant=options.batch_invariant,
            experts=options.experts,
            vision=VisionConfig.from_hf(checkpoint.hf_config.get("vision_config")),
            image_token_id=checkpoint.hf_config.get("image_token_id", -1),
        )
        model.tensor_schema = tensor_schema(text_config)
        model.expand_weights = options.expand_weights
        model.kernels = options.kernels
        for module in model.modules():
            if isinstance(module, MoE):
                module.forced_routing = options.forced_routing
        return model

    def kv_layout(self) -> KVLayout:
        return kv_layout(self.config, dspark=self.dspark is not None)

    def hooks(self) -> ModelHooks:
        return ModelHooks(
            output_head=self.head,
            routed_experts=RoutedExperts([block.ffn for block in self.layers], is_routed_expert),
            draft_stages=self.dspark,
            # Its window rings and compressor tails are read by its own layers, which have
            # batch-invariant paths.
            invariant_rings=True,
            context_parallel=V41ContextParallel(self),
            image_encoder=self.image_encoder,
            fixed_decode_plans=True,
            graph_blocker=moe_graph_blocker(block.ffn for block in self.layers),
        )

    def forward(self, input_ids, positions, meta: StepMetadata, kv_cache: KVCache):
        c = self.config
        num_rows = input_ids.shape[0]
        history = meta.token_history
        image_rows = None if meta.images is None else meta.images.mask
        rows_alone = self.batch_invariant and _rows_alone(input_ids)
        if self.batch_invariant and not rows_alone:
            input_ids, positions, history, image_rows = _pad_to_row_tiles(
                input_ids, positions, history, image_rows
            )
        rotations = self._rotations(positions, rows_alone)
        streams, pre = self.initial_streams(input_ids, meta.images)
        if self.engram_tables is not None:
            history = torch.cat((input_ids.unsqueeze(1), history), dim=1)
        shared: dict[int, SharedSelection] = {}
        step = meta
        features: list[torch.Tensor] = []
        targets = () if self.dspark is None else self.dspark.targets
        for block, ring in zip(self.layers, kv_cache.rings["window"], strict=True):
            plan = block.plan
            compressed = self.compressed_caches(plan, kv_cache)
            engram_rows = None
            if block.engram is not None:
                engram_rows = ngram_rows(self.engram_tables, plan.engram_slot, history)
            consumer = self.yoco_boundary is not None and plan.index >= self.yoco_boundary
            if plan.index == self.yoco_boundary and meta.compact is not None:
                # Compact bounded replay: the boundary layer still compresses the dropped
                # rows (the consumers' shared KV covers every position), then every row
                # before its sequence's replay start leaves the step.
                compact = meta.compact
                dropped = compact.dropped_rows
                u = block.attention_input(
                    streams[dropped],
                    pre[dropped],
                    None if engram_rows is None else engram_rows[dropped],
                    self.dtype,
                    None if image_rows is None else image_rows[dropped],
                )
                block.attn.write_entries(u, compact.dropped, compressed)
                kept = compact.rows
                if not kept.numel():
                    return streams.new_zeros(num_rows, c.hidden_size)
                streams, pre = streams[kept], pre[kept]
                rotations = {key: value[kept] for key, value in rotations.items()}
                history = None if history is None else history[kept]
                engram_rows = None if engram_rows is None else engram_rows[kept]
                image_rows = None if image_rows is None else image_rows[kept]
                shared.clear()
                # DSpark's context rings then take the kept rows only: replay keeps at
                # least a window, all a draft reads.
                features[:] = [feature[kept] for feature in features]
                positions = positions[kept]
                step = compact.kept
            streams, pre = block(
                streams,
                pre,
                rotations[bool(plan.compress_ratio)],
                step,
                _window_plan(step, consumer),
                ring,
                compressed,
                shared,
                engram_rows,
                self.dtype,
                features if plan.index in targets else None,
                num_rows,
                image_rows,
            )
        if self.dspark is not None:
            self.dspark.write_context(features, positions, step, kv_cache.rings[DSPARK_RING])
        hidden = self.norm(collapse(streams, pre))
        if step is meta:
            return hidden[:num_rows]
        # Rows the consumers skipped sample nothing: zeros keep the step's row order.
        full = hidden.new_zeros(num_rows, hidden.shape[-1])
        full[meta.compact.rows] = hidden
        return full

    def _rotations(self, positions: torch.Tensor, rows_alone: bool) -> dict[bool, torch.Tensor]:
        """The plain and the compressing layers' rotations (keyed by "compresses"), each
        row's alone when the step's rows must not share vector lanes."""
        if rows_alone:
            return {
                False: self.plain_rotary.invariant_rotation(positions),
                True: self.compress_rotary.invariant_rotation(positions),
            }
        return {
            False: self.plain_rotary.rotation(positions),
            True: self.compress_rotary.rotation(positions),
        }

    def initial_streams(
        self, input_ids: torch.Tensor, images: StepImages | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual at the embedding: every stream the token's embedding (an image
        row's: its span embedding), and the carried `pre` one-hot on the first stream
        (spec §3.2)."""
        hc = self.config.hc_mult
        embedded = self.embed(input_ids).float()
        if images is not None:
            embedded[images.rows] = images.embeddings.to(embedded.device).float()
        streams = embedded.unsqueeze(1).expand(-1, hc, -1)
        pre = torch.zeros(input_ids.shape[0], hc, device=input_ids.device)
        pre[:, 0] = 1
        return streams, pre

    def compressed_caches(self, plan: LayerPlan, kv_cache: KVCache) -> CompressedCaches | None:
        """The caches of the layer's KV source; None for a window-only layer."""
        if not plan.compress_ratio:
            return None
        ratio, source = self._source_slots[plan.index]
        tails = kv_cache.rings.get(f"compressor_tail_r{ratio}")
        return CompressedCaches(
            kv_cache.paged[f"compressed_r{ratio}"][source],
            kv_cache.paged[f"index_keys_r{ratio}"][source],
            None if tails is None else tails[source],
        )

    def compute_logits(
        self, hidden: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logits of `hidden`'s rows `rows` (every row when None), float32: the head
        computes in float32."""
        return self.head((hidden if rows is None else hidden[rows]).float())

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Bind the mapped checkpoint's tensors (stored as released, spec §3.8) in place of
        the meta parameters: kept packed, or dequantised to the model's dtype with
        `expand_weights` (binding.py); every parameter must be set. `mtp.*` (DSpark) binds
        only when DSpark is on; the vision tower, when the config has one, first."""

        def targets(source: str) -> list[str]:
            if is_draft_stage(source) and self.dspark is None:
                return []
            return self._local_names(_parameter_name(re.sub(r"^mtp\.", "dspark.stages.", source)))

        if not self.tensor_schema:
            raise ModelLoadError(
                "the model knows no checkpoint schema: build it with from_checkpoint, or set "
                "tensor_schema from the checkpoint's text_config (schema.tensor_schema)"
            )
        if self.image_encoder is not None:
            self.image_encoder.load(tensors)
        bind_weights(self, tensors, self.tensor_schema, targets, self.dtype, self.expand_weights)
        if self.kernels == TRITON:
            use_triton_kernels(self)

    def _local_names(self, name: str) -> list[str]:
        """Where a parameter goes: with expert parallelism a routed expert of the backbone
        goes to each of this rank's slots that hold it (none: another rank's)."""
        routed = _ROUTED_EXPERT.match(name)
        if self.expert_sharding is None or routed is None:
            return [name]
        layer, expert, rest = routed.groups()
        sharding = self.expert_sharding
        held = sharding.placement.rank_experts(sharding.group.rank)
        return [
            f"layers.{layer}.ffn.experts.{slot}.{rest}"
            for slot, logical in enumerate(held)
            if logical == int(expert)
        ]


def kv_layout(config: DeepseekV41Config, dspark: bool) -> KVLayout:
    """Every cache of the model (`dspark`: with the draft stages' context rings), its
    window rows, compressed entries and index keys in their stored form (CacheStorage: by
    default the released bytes, spec §4)."""
    c = config
    storage = CacheStorage.of(c)
    plans = c.layer_plans()
    sources = c.kv_sources
    yoco_boundary = _yoco_boundary(plans)
    paged = []
    for ratio in sorted(sources):
        for name, rows in (("compressed", storage.entries), ("index_keys", storage.index_keys)):
            paged.append(
                PagedSpec(
                    f"{name}_r{ratio}",
                    len(sources[ratio]),
                    rows.entry_shape,
                    compress_ratio=ratio,
                    role=CacheRole.COMPRESSED,
                    dtype=rows.dtype,
                )
            )
    window = storage.window
    rings = [
        RingSpec(
            "window",
            len(plans),
            window.entry_shape,
            c.sliding_window,
            MAX_BACKTRACK,
            dtype=window.dtype,
            consumers_from=yoco_boundary,
        )
    ]
    for ratio in sorted(r for r in sources if r > 1):
        # (kv, gate) projections of a group's first positions, kept in float32 (§4).
        rings.append(
            RingSpec(
                f"compressor_tail_r{ratio}",
                len(sources[ratio]),
                (2, c.head_dim),
                ratio - 1,
                MAX_BACKTRACK,
                dtype=torch.float32,
                role=CacheRole.COMPRESSOR_TAIL,
            )
        )
    if dspark:
        # Fed by the target layers' features: consumers once any target is one.
        reads_consumers = yoco_boundary is not None and any(
            t >= yoco_boundary for t in c.dspark_target_layer_ids
        )
        # One context ring per draft stage: their window of projected target features.
        rings.append(
            RingSpec(
                DSPARK_RING,
                c.num_nextn_predict_layers,
                window.entry_shape,
                c.sliding_window,
                MAX_BACKTRACK,
                dtype=window.dtype,
                consumers_from=0 if reads_consumers else None,
            )
        )
    engram = any(p.engram_slot >= 0 for p in plans)
    return KVLayout(
        paged=tuple(paged),
        rings=tuple(rings),
        ring_snapshots=True,
        yoco_boundary=yoco_boundary,
        token_history=c.engram_max_ngram_size - 1 if engram else 0,
    )


def _yoco_boundary(plans: tuple[LayerPlan, ...]) -> int | None:
    """DeepInfer's n_prefill_layer: the first ratio-1 layer, when every layer from it on
    reads only its compressed KV (or none), so the layers before it decide all paged state
    and the ones after keep nothing but their own windows (spec/deepinfer.md §1.6)."""
    boundary = next((p.index for p in plans if p.compress_ratio == 1), None)
    if boundary is None:
        return None
    for plan in plans[boundary + 1 :]:
        if plan.selection is Selection.FULL or plan.kv_source not in (-1, boundary):
            return None
    return boundary


_ROUTED_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(.+)$")
# A backbone block or a draft stage (released `mtp.K`, renamed before matching).
_BLOCK = r"(?:layers|dspark\.stages)\.\d+"
_PARAMETER_NAMES = (
    (re.compile(rf"({_BLOCK})\.hc_(attn|ffn)_(fn|base|scale)$"), r"\1.hc_\2.\3"),
    (re.compile(rf"({_BLOCK}\.ffn)\.gate\.weight$"), r"\1.gate"),
    (re.compile(rf"({_BLOCK}\.ffn)\.gate\.bias$"), r"\1.gate_bias"),
    (re.compile(rf"({_BLOCK}\.ffn)\.gate\.bias_vl$"), r"\1.gate_bias_vl"),
    (re.compile(rf"({_BLOCK}\.ffn)\.shared_experts\.(w[123])\.weight$"), r"\1.shared_expert.\2"),
    (re.compile(rf"({_BLOCK}\.ffn\.experts\.\d+)\.(w[13])\.weight$"), r"\1.\2"),
)


def _parameter_name(released: str) -> str:
    """Our parameter name for a released tensor name; w1/w3 come back as their half names
    (fused into w13 by the caller), w2 as a plain weight."""
    for pattern, replacement in _PARAMETER_NAMES:
        if pattern.search(released):
            name = pattern.sub(replacement, released)
            return name if not name.endswith(".w2") else name + ".weight"
    return released


def _rows_alone(input_ids: torch.Tensor) -> bool:
    """Whether a batch-invariant step runs its rows unpadded: on the CPU where the per-row
    kernels build (invariant_rows.cpp's products, mHC, rotary), each row computed alone and
    every elementwise pass in whole vector bodies (layers/batch_invariant.py). Elsewhere the
    step is padded to whole row tiles."""
    return row_kernels(input_ids) and native_ops() and native_rotation()


def _pad_to_row_tiles(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    history: torch.Tensor | None,
    image_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Whole row tiles: every elementwise pass over the step's rows then covers a multiple of
    the vector width, so no row falls in a kernel's scalar tail (whose exp or sigmoid rounds
    otherwise); sequences never read the padding."""
    padding = -input_ids.shape[0] % ROW_TILE
    input_ids = F.pad(input_ids, (0, padding))
    positions = F.pad(positions, (0, padding))
    if history is not None:
        history = F.pad(history, (0, 0, 0, padding), value=-1)
    if image_rows is not None:
        image_rows = F.pad(image_rows, (0, padding))
    return input_ids, positions, history, image_rows


def _window_plan(step: StepMetadata, consumer: bool):
    """The attention window a block reads this step: the fixed-size plan of a decode-graph
    step, else the step's own (a YOCO consumer's starts at its replay start)."""
    if step.fixed is not None:
        return step.fixed.window("window", consumer)
    return step.consumer_windows("window") if consumer else step.windows["window"]
