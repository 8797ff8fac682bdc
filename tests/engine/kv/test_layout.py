"""KV layouts of every kind a model may declare, and the manager allocating from them."""

import torch

from deepwell.engine import SamplingParams
from deepwell.engine.kv.cache import KVCache
from deepwell.engine.kv.layout import CacheRole, KVLayout, PagedSpec, RingSpec, StateSpec
from deepwell.engine.kv.manager import KVCacheManager
from deepwell.engine.request import Request

# Shaped like DeepSeek-V4.1 (spec/deepseek_v41.md §4), scaled down: compressed main KV at
# ratio 2 and 1, a sliding-window ring of window + backtracking rows, a compressor tail.
V41_LIKE = KVLayout(
    paged=(
        PagedSpec("compressed_r2", num_layers=3, entry_shape=(8,), compress_ratio=2),
        PagedSpec("compressed_r1", num_layers=1, entry_shape=(8,)),
    ),
    rings=(RingSpec("window", num_layers=4, entry_shape=(8,), window=16, max_backtrack=6),),
    states=(StateSpec("compressor_tail", num_layers=3, state_shape=(2, 8)),),
)


def request(num_tokens: int) -> Request:
    params = SamplingParams(max_tokens=1)
    return Request("r", [1] * num_tokens, params, frozenset(), torch.Generator())


def test_block_and_slot_sizes_follow_the_declared_specs():
    element = 2
    # per 16-token block: 3 layers x 8 entries x 8 + 1 layer x 16 entries x 8
    assert V41_LIKE.block_bytes(16, torch.bfloat16) == (3 * 8 * 8 + 16 * 8) * element
    assert V41_LIKE.slot_bytes(torch.bfloat16) == (4 * 22 * 8 + 3 * 2 * 8) * element


def test_a_spec_with_its_own_dtype_is_sized_and_allocated_in_it():
    tail = StateSpec("compressor_tail", num_layers=3, state_shape=(2, 8), dtype=torch.float32)
    layout = KVLayout(paged=V41_LIKE.paged, rings=V41_LIKE.rings, states=(tail,))
    assert layout.slot_bytes(torch.bfloat16) == 4 * 22 * 8 * 2 + 3 * 2 * 8 * 4
    cache = KVCache.allocate(layout, num_blocks=2, block_size=16, num_slots=3, dtype=torch.bfloat16)
    assert cache.states["compressor_tail"][0].dtype == torch.float32
    assert cache.rings["window"][0].dtype == torch.bfloat16


def test_snapshot_rows_widen_only_window_rings_by_a_block():
    tail = RingSpec("tail", 3, (2, 8), window=1, max_backtrack=6, role=CacheRole.COMPRESSOR_TAIL)
    layout = KVLayout(paged=V41_LIKE.paged, rings=(*V41_LIKE.rings, tail), ring_snapshots=True)
    widened = layout.with_snapshot_rows(16)
    assert [r.rows for r in widened.rings] == [16 + 6 + 16, 1 + 6]
    # A chunk starting at a block boundary reads the window's last 15 rows and no tail row.
    assert [r.rows_before_boundary(16) for r in widened.rings] == [15, 0]


def test_cache_tensors_have_blocks_and_slots_leading():
    cache = KVCache.allocate(
        V41_LIKE, num_blocks=5, block_size=16, num_slots=3, dtype=torch.float32
    )
    assert cache.paged["compressed_r2"][0].shape == (5, 8, 8)
    assert cache.paged["compressed_r1"][0].shape == (5, 16, 8)
    assert cache.rings["window"][0].shape == (3, 22, 8)
    assert cache.states["compressor_tail"][2].shape == (3, 2, 8)


def test_head_major_entry_axis_places_tokens_after_heads():
    spec = PagedSpec("key", num_layers=1, entry_shape=(3, 64), entry_axis=1)
    assert spec.block_shape(128) == (3, 128, 64)


def test_manager_gives_a_slot_and_blocks_and_takes_both_back():
    kv = KVCacheManager(V41_LIKE, num_blocks=4, block_size=16, num_slots=2)
    first, second, third = request(20), request(10), request(5)
    kv.allocate(first, 20)
    assert len(first.block_ids) == 2 and first.slot is not None
    kv.allocate(second, 10)
    # Blocks remain, but both state slots are taken.
    assert not kv.can_allocate(third, 5)
    kv.free(first)
    assert kv.can_allocate(third, 5)
    kv.free(second)
    assert kv.block_pool.num_free == 4 and kv.slot_pool.num_free == 2


def test_llama_layout_needs_no_slots():
    layout = KVLayout(paged=(PagedSpec("key", 2, (2, 4), entry_axis=1),))
    kv = KVCacheManager(layout, num_blocks=2, block_size=8, num_slots=3)
    r = request(9)
    kv.allocate(r, 9)
    assert r.slot is None and len(r.block_ids) == 2


def test_max_backtrack_raises_every_ring_and_the_drafts_it_allows():
    assert V41_LIKE.max_draft_tokens(8) == 5
    deeper = V41_LIKE.with_max_backtrack(9)
    assert [ring.max_backtrack for ring in deeper.rings] == [9]
    assert deeper.rings[0].rows == 16 + 9
    assert deeper.max_draft_tokens(8) == 8
    # The model's own rollback rows stay the floor.
    assert V41_LIKE.with_max_backtrack(2).rings == V41_LIKE.rings
