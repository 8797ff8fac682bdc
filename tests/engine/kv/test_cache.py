"""KVCache allocation: nothing written up front, nothing resident until used, and every
block and slot cleared as the manager hands it out."""

from pathlib import Path

import torch

from deepwell.engine import SamplingParams
from deepwell.engine.kv.cache import KVCache
from deepwell.engine.kv.layout import KVLayout, PagedSpec, RingSpec, StateSpec
from deepwell.engine.kv.manager import KVCacheManager
from deepwell.engine.request import Request

MIB = 1 << 20
LAYOUT = KVLayout(
    paged=(PagedSpec("kv", num_layers=2, entry_shape=(8,)),),
    rings=(RingSpec("window", num_layers=2, entry_shape=(8,), window=16, max_backtrack=6),),
    states=(StateSpec("tail", num_layers=1, state_shape=(2, 8)),),
)


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_kv_budget_becomes_resident_only_as_blocks_are_written():
    layout = KVLayout(paged=(PagedSpec("kv", num_layers=1, entry_shape=(MIB // 16,)),))
    before = resident_bytes()
    cache = KVCache.allocate(layout, 512, 16, 1, torch.uint8)
    allocated = resident_bytes()
    cache.clear_blocks(list(range(64)))
    cleared = resident_bytes()
    cache.paged["kv"][0][:64].fill_(1)
    written = resident_bytes()
    assert allocated - before < 32 * MIB  # 512 MiB asked, nothing touched
    assert cleared - allocated < 8 * MIB  # blocks never handed out are zero untouched
    assert written - cleared >= 60 * MIB  # the 64 MiB written are now resident


def request(request_id: str) -> Request:
    return Request(
        request_id, [1] * 40, SamplingParams(max_tokens=1), frozenset(), torch.Generator()
    )


def test_blocks_never_handed_out_come_zero_and_are_marked_as_they_go():
    cache = KVCache.allocate(LAYOUT, 8, 16, 3, torch.float32)
    manager = KVCacheManager(LAYOUT, 8, 16, 3, cache=cache)
    first = request("r")
    manager.allocate(first, 40)
    assert len(first.block_ids) == 3
    assert list(cache.holds_rows) == [int(b in first.block_ids) for b in range(8)]
    for tensor in cache.block_tensors():
        assert not tensor.any()


def test_blocks_and_slots_are_cleared_as_they_are_handed_out_again():
    cache = KVCache.allocate(LAYOUT, 8, 16, 3, torch.float32)
    manager = KVCacheManager(LAYOUT, 8, 16, 3, cache=cache)
    first = request("first")
    manager.allocate(first, 40)
    used = list(first.block_ids)
    # What an earlier request may leave: anything, NaN included.
    for tensors in (*cache.paged.values(), *cache.rings.values(), *cache.states.values()):
        for tensor in tensors:
            tensor.fill_(float("nan"))
    manager.free(first)
    second = request("second")
    manager.allocate(second, 40)
    given = second.block_ids
    assert sorted(given) == sorted(used)
    others = [block for block in range(8) if block not in given]
    for tensor in cache.block_tensors():
        assert not tensor[given].any()  # zero, not NaN
        assert tensor[others].isnan().all()
    for tensor in (*cache.rings["window"], *cache.states["tail"]):
        assert not tensor[second.slot].any()
        assert tensor[[s for s in range(3) if s != second.slot]].isnan().all()


def test_blocks_filled_from_the_store_are_cleared_when_handed_out_again():
    cache = KVCache.allocate(LAYOUT, 8, 16, 3, torch.float32)
    block = [torch.full(t.shape[1:], float("nan")) for t in cache.block_tensors()]
    cache.write_blocks([5], [block])
    cache.clear_blocks([5, 6])
    for tensor in cache.block_tensors():
        assert not tensor[[5, 6]].any()
