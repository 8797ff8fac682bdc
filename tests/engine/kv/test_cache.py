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
    written = resident_bytes()
    assert allocated - before < 32 * MIB  # 512 MiB asked, nothing touched
    assert written - allocated >= 60 * MIB  # the 64 MiB cleared are now resident


def test_blocks_and_slots_are_cleared_as_they_are_handed_out():
    cache = KVCache.allocate(LAYOUT, 8, 16, 3, torch.float32)
    for tensors in (*cache.paged.values(), *cache.rings.values(), *cache.states.values()):
        for tensor in tensors:
            tensor.fill_(float("nan"))
    manager = KVCacheManager(LAYOUT, 8, 16, 3, cache=cache)
    request = Request("r", [1] * 40, SamplingParams(max_tokens=1), frozenset(), torch.Generator())
    manager.allocate(request, 40)
    given = request.block_ids
    assert len(given) == 3
    others = [block for block in range(8) if block not in given]
    for tensor in cache.block_tensors():
        assert not tensor[given].any()  # zero, not NaN
        assert tensor[others].isnan().all()
    for tensor in (*cache.rings["window"], *cache.states["tail"]):
        assert not tensor[request.slot].any()
        assert tensor[[s for s in range(3) if s != request.slot]].isnan().all()
