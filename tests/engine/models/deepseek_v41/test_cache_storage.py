"""DeepSeek-V4.1's caches in their released bytes (spec §3.7, §4): what they cost, and that a
step computes with exactly the values a cache of rounded floats would give it."""

import dataclasses

import pytest
import torch

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.kv.cache import KVCache
from deepwell.engine.kv.layout import CacheRole
from deepwell.engine.layers.step_metadata import SequenceSpan, StepMetadata
from deepwell.engine.layers.torch_paged import TorchPagedAttention
from deepwell.engine.models.deepseek_v41.cache_storage import (
    FP8,
    MXFP4,
    NVFP4,
    KVStorage,
    StoredRows,
    native_rows,
)
from deepwell.engine.models.deepseek_v41.config import DeepseekV41Config
from deepwell.engine.models.deepseek_v41.dspark import DSPARK_RING
from deepwell.engine.models.deepseek_v41.model import DeepseekV41ForCausalLM, kv_layout
from deepwell.engine.models.deepseek_v41.writer import RELEASED_CACHE_SHAPE, write_tiny_checkpoint
from deepwell.engine.models.loader import load_checkpoint
from deepwell.engine.models.registry import ModelOptions
from deepwell.engine.runner import ModelRunner

from ...tiny_llama import run_to_completion

BLOCK = 16


def real_config(**fields) -> DeepseekV41Config:
    return dataclasses.replace(DeepseekV41Config.from_hf(RELEASED_CACHE_SHAPE), **fields)


def test_the_real_config_keeps_890_bytes_a_token_and_528_byte_window_rows():
    layout = kv_layout(real_config(), dspark=True)
    # Three ratio-2 sources (an entry per 2 tokens) and one ratio-1 source, each an nvfp4
    # entry and an mxfp4 index key: 3·(288 + 68)/2 + (288 + 68).
    assert layout.block_bytes(128, torch.bfloat16) == 890 * 128
    paged = {spec.name: (spec.entry_shape, spec.dtype) for spec in layout.paged}
    assert paged["compressed_r2"] == paged["compressed_r1"] == ((288,), torch.uint8)
    assert paged["index_keys_r2"] == paged["index_keys_r1"] == ((68,), torch.uint8)
    rings = {ring.name: ring for ring in layout.rings}
    for name in ("window", DSPARK_RING):
        assert (rings[name].entry_shape, rings[name].dtype) == ((528,), torch.uint8)
    # 40 + 3 window rings of 128 + 6 rows (≈2.9 MB, spec §4), three float32 compressor
    # tails of 1 + 6 rows of (kv, gate).
    assert layout.slot_bytes(torch.bfloat16) == 43 * 134 * 528 + 3 * 7 * 2 * 512 * 4


def test_without_packing_the_same_caches_take_their_compute_dtype():
    layout = kv_layout(real_config(cache_packed=False), dspark=True)
    # 3·(1024 + 256)/2 + (1024 + 256) bytes of bfloat16 a token: 3.6 times the packed size.
    assert layout.block_bytes(128, torch.bfloat16) == 3200 * 128
    window = next(ring for ring in layout.rings if ring.role is CacheRole.WINDOW)
    assert (window.entry_shape, window.dtype) == ((512,), None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=0).path


class Driver:
    """One model on hand-made steps: its own caches, the runner's step plans, disjoint
    blocks and slots per sequence."""

    def __init__(self, model: DeepseekV41ForCausalLM, dtype: torch.dtype, blocks: int) -> None:
        layout = model.kv_layout()
        self.cache = KVCache.allocate(layout, 2 * blocks, BLOCK, 2, dtype)
        # It hands out every block and slot itself, so clears them as the manager would.
        self.cache.clear_blocks(list(range(2 * blocks)))
        for slot in range(2):
            self.cache.clear_slot(slot)
        self.runner = ModelRunner(model, self.cache, BLOCK, False, layout)
        self.blocks = blocks

    def step(self, sequences: list[list[int]], chunks: list[tuple[int, int, int]]):
        """chunks: (sequence, start, rows); returns every row's logits."""
        depth = self.runner.token_history
        ids, positions, spans, history = [], [], [], []
        for index, start, rows in chunks:
            tokens = sequences[index]
            first = index * self.blocks
            table = torch.arange(first, first + -(-(start + rows) // BLOCK))
            spans.append(SequenceSpan(len(ids), rows, start, index, table))
            ids += tokens[start : start + rows]
            positions += range(start, start + rows)
            for p in range(start, start + rows):
                history.append([tokens[p - s] if p >= s else -1 for s in range(1, depth + 1)])
        meta = StepMetadata(spans)
        self.runner.plan_caches(meta)
        meta.token_history = torch.tensor(history).view(-1, depth)
        model = self.runner.model
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(positions), meta, self.cache)
            return model.compute_logits(hidden)

    def draft(self, anchors: list[int], positions: list[int]):
        model = self.runner.model
        rings = self.cache.rings[DSPARK_RING]
        with torch.inference_mode():
            return model.dspark.block(
                model.embed,
                torch.tensor(anchors),
                torch.tensor(positions),
                [0, 1],
                rings,
                rings[0].shape[1],
                model.dtype,
            )


def models(checkpoint, dtype: torch.dtype) -> tuple[DeepseekV41ForCausalLM, ...]:
    """The packed (default) model and one keeping the rounded values in `dtype`."""
    loaded = load_checkpoint(str(checkpoint))
    options = ModelOptions(dtype=dtype, backend_class=TorchPagedAttention, dspark=True)
    packed = DeepseekV41ForCausalLM.from_checkpoint(loaded, options)
    rounded = DeepseekV41ForCausalLM(
        dataclasses.replace(packed.config, cache_packed=False),
        dtype,
        packed.engram_tables,
        dspark=True,
    )
    rounded.tensor_schema = packed.tensor_schema  # what from_checkpoint reads off config.json
    for model in (packed, rounded):
        model.load_weights(loaded.tensors)
    return packed, rounded


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_caches_give_the_logits_and_drafts_of_rounded_float_caches_bit_for_bit(
    checkpoint, dtype
):
    packed, rounded = models(checkpoint, dtype)
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, 250, (56,), generator=generator).tolist() for _ in range(2)]
    drivers = [Driver(model, dtype, blocks=4) for model in (packed, rounded)]
    # Chunks below and across the window (8), both compress ratios and a block (16), a
    # mixed prefill-and-decode step, then decodes.
    steps = [
        [(0, 0, 17), (1, 0, 9)],
        [(0, 17, 3), (1, 9, 1)],
        [(0, 20, 28), (1, 10, 38)],
        *[[(0, p, 1), (1, p, 1)] for p in range(48, 56)],
    ]
    for chunks in steps:
        got, expected = (driver.step(sequences, chunks) for driver in drivers)
        assert same_bits(got.float(), expected.float())
    # The draft stages read the context rings the target filled.
    for got, expected in zip(*(d.draft([5, 9], [55, 55]) for d in drivers), strict=True):
        assert same_bits(got.float(), expected.float())
    window, entries = (
        drivers[0].cache.rings["window"][0],
        drivers[0].cache.paged["compressed_r2"][0],
    )
    assert window.dtype == entries.dtype == torch.uint8
    # head_dim 32: 32 fp8 codes + 1 scale; 16 bytes of fp4 codes + 2 e4m3 scales.
    assert (window.shape[-1], entries.shape[-1]) == (33, 18)


@pytest.fixture(scope="module")
def make_core(checkpoint):
    def make(**kwargs) -> EngineCore:
        defaults = dict(
            model=str(checkpoint),
            dtype="float32",
            max_model_len=256,
            block_size=BLOCK,
            memory_gib=0.5,
            max_num_batched_tokens=20,
        )
        return EngineCore(EngineArgs(**(defaults | kwargs)))

    return make


def generate(core: EngineCore, tokens: list[int], name: str):
    """(prompt tokens from the cache, tokens, logprobs) of one greedy request."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    core.add_request(name, tokens, params)
    cached, logprobs = 0, []
    while core.has_unfinished():
        for output in core.step():
            logprobs += output.new_logprobs
            cached = output.num_cached_tokens
    return cached, [lp.token_id for lp in logprobs], [lp.logprob for lp in logprobs]


def test_the_kv_store_keeps_packed_blocks_and_snapshots_and_a_hit_matches_no_cache(
    make_core, tmp_path
):
    first = torch.randint(3, 250, (47,), generator=torch.Generator().manual_seed(7)).tolist()
    writer = make_core(kv_store_path=str(tmp_path), num_speculative_tokens=0)
    _, answer, _ = generate(writer, first, "first")
    writer.close()
    second = first + answer + [11, 12, 13, 14, 15, 16]
    reader = make_core(kv_store_path=str(tmp_path), num_speculative_tokens=0)
    layout = reader.runner.layout
    store = reader.kv.store
    assert store.store.payload_bytes == layout.block_bytes(BLOCK, torch.float32)
    assert store.snapshots.payload_bytes == reader.kv.snapshots.snapshot_bytes
    # The tiny config's 2 ratio-2 and 1 ratio-1 sources, 18-byte entries, 17-byte keys.
    assert layout.block_bytes(BLOCK, torch.float32) == (2 * 8 + 16) * (18 + 17)
    assert all(part.dtype == torch.uint8 for part in reader.kv.snapshots.parts)
    cached, tokens, logprobs = generate(reader, second, "second")
    fresh = make_core(enable_prefix_caching=False, num_speculative_tokens=0)
    _, fresh_tokens, fresh_logprobs = generate(fresh, second, "second")
    assert cached == 48
    assert reader.stats().store_hits == 3 + 1 and reader.stats().store_errors == 0
    assert tokens == fresh_tokens
    assert logprobs == pytest.approx(fresh_logprobs, abs=1e-5)
    reader.close()


def test_dspark_drafting_over_packed_rings_keeps_greedy_output(checkpoint):
    generator = torch.Generator().manual_seed(4)
    lengths = torch.randint(2, 40, (4,), generator=generator).tolist()
    batch = [torch.randint(3, 250, (n,), generator=generator).tolist() for n in lengths]
    outputs = []
    for speculative in ({"num_speculative_tokens": 0}, {}):
        args = dict(model=str(checkpoint), dtype="float32", max_model_len=256, memory_gib=0.5)
        core = EngineCore(EngineArgs(**args, **speculative))
        for index, tokens in enumerate(batch):
            core.add_request(f"r{index}", tokens, SamplingParams(max_tokens=32, temperature=0))
        outputs.append(run_to_completion(core))
    stats = core.speculator.stats()
    # Verify steps rolled back rejected rows in the packed rings.
    assert stats.verified_tokens > stats.accepted_tokens > 0
    assert outputs[0] == outputs[1]


@pytest.fixture
def native_rows_ops():
    if not native_rows():
        pytest.skip("the V4.1 cache rows kernel cannot build here (no compiler)")


@pytest.mark.parametrize("channels", [128, 64, 100])
@pytest.mark.parametrize("cache_format", [FP8, NVFP4, MXFP4], ids=["fp8", "nvfp4", "mxfp4"])
def test_native_unpack_gives_the_torch_unpacks_bits(native_rows_ops, cache_format, channels):
    gen = torch.Generator().manual_seed(channels)
    # Every byte value, NaN and subnormal codes and scales among them.
    packed = torch.randint(0, 256, (37, 3, cache_format.row_bytes(channels)), generator=gen)
    packed = packed.to(torch.uint8)
    got = cache_format.native_unpack(packed, channels)
    want = cache_format.unpack(packed, channels)
    assert got.shape == want.shape == (37, 3, channels)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels", [128, 100])
def test_native_window_packing_gives_the_torch_bytes_and_values(native_rows_ops, dtype, channels):
    gen = torch.Generator().manual_seed(channels)
    # Magnitudes from tiny (the 1e-4 scale floor) to large, and an all-zero row.
    x = torch.randn(50, channels, generator=gen) * torch.logspace(-6, 3, 50).unsqueeze(1)
    x[7] = 0
    x = x.to(dtype)
    stored, values = torch.ops.deepwell_v41_cache.pack_fp8(x)
    assert torch.equal(stored, FP8.pack(x))
    assert torch.equal(values, FP8.unpack(FP8.pack(x), channels))
    rows = StoredRows(FP8, channels, KVStorage.PACKED)
    rounded, kept = rows.rounded_and_stored(x)
    assert torch.equal(kept, stored) and rounded.dtype == dtype


def test_native_unpack_refuses_rows_of_the_wrong_width(native_rows_ops):
    with pytest.raises(RuntimeError, match="a packed fp8 row is 132 uint8 bytes"):
        torch.ops.deepwell_v41_cache.unpack_fp8(torch.zeros(2, 130, dtype=torch.uint8), 128)
