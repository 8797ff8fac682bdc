"""The KV store: round trips, and every bad file (corrupt, truncated, foreign, expired)
detected and ignored; capacity eviction; store hits across engines and processes."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deepwell.engine import SamplingParams, build
from deepwell.engine.kv.store import HEADER, KVStore, StoreConfig

from .test_prefix_cache import PREFIX, generate

PARTS = [((2, 4, 3), torch.float32), ((5,), torch.bfloat16)]
FINGERPRINT = b"f" * 16
DAY = 86400.0


def make_store(path: Path, capacity_bytes: int = 1 << 20, fingerprint=FINGERPRINT) -> KVStore:
    return KVStore(StoreConfig(str(path), capacity_bytes), fingerprint, PARTS)


def block(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for shape, dtype in PARTS]


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


def test_a_block_reads_back_bit_for_bit(tmp_path):
    store = make_store(tmp_path)
    store.write(key(1), block(1), "chat")
    read = store.read(key(1), "chat")
    assert all(torch.equal(a, b) for a, b in zip(read, block(1), strict=True))
    assert store.read(key(2), "chat") is None
    stats = store.stats
    assert (stats.hits, stats.misses, stats.errors) == (1, 1, 0)
    assert stats.read_bytes == stats.written_bytes == HEADER.size + store.payload_bytes


def test_the_traffic_class_sets_the_expiry(tmp_path):
    store = make_store(tmp_path)
    store.write(key(1), block(1), "agent")
    store.write(key(2), block(2), "chat")
    now = time.time()
    assert store.path_of(key(1)).stat().st_mtime == pytest.approx(now + 3 * DAY, abs=60)
    assert store.path_of(key(2)).stat().st_mtime == pytest.approx(now + 7 * DAY, abs=60)
    # A chat hit keeps an agent block for a chat TTL.
    store.read(key(1), "chat")
    assert store.path_of(key(1)).stat().st_mtime == pytest.approx(now + 7 * DAY, abs=60)


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER.size + 3] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def foreign(path: Path) -> None:
    # Another model's block, under this key's name.
    path.unlink()
    other = make_store(path.parent.parent, fingerprint=b"g" * 16)
    other.write(key(1), block(1), "chat")


@pytest.mark.parametrize("damage", [corrupt, truncate, foreign])
def test_a_damaged_file_is_counted_ignored_and_removed(tmp_path, damage):
    store = make_store(tmp_path)
    store.write(key(1), block(1), "chat")
    path = store.path_of(key(1))
    expiry = path.stat().st_mtime
    damage(path)
    os.utime(path, (expiry, expiry))
    assert store.read(key(1), "chat") is None
    assert store.stats.errors == 1 and not path.exists()
    store.write(key(1), block(1), "chat")  # recomputed, written again
    assert store.read(key(1), "chat") is not None


def test_an_expired_block_is_a_miss_and_the_sweeper_deletes_it(tmp_path):
    store = make_store(tmp_path)
    for n in (1, 2):
        store.write(key(n), block(n), "chat")
    past = time.time() - 1
    for n in (1, 2):
        os.utime(store.path_of(key(n)), (past, past))
    assert store.read(key(1), "chat") is None
    assert store.sweep() == 0
    assert store.stats.expired == 2 and not store.path_of(key(2)).exists()


def test_beyond_capacity_the_soonest_expiring_blocks_go_first(tmp_path):
    size = HEADER.size + make_store(tmp_path).payload_bytes
    store = make_store(tmp_path, capacity_bytes=int(2.5 * size))
    now = time.time()
    for n in range(4):
        store.write(key(n), block(n), "chat")
        os.utime(store.path_of(key(n)), (now, now + 1000 * (n + 1)))
    assert store.sweep() == 2 * size
    assert [store.path_of(key(n)).exists() for n in range(4)] == [False, False, True, True]
    assert store.stats.evicted == 2


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_a_fresh_engine_hits_the_store_and_matches_memory_and_no_cache(make_core, tmp_path):
    second = PREFIX + [20, 21, 22]
    writer = make_core(kv_store_path=str(tmp_path))
    (_, (memory, memory_cached)) = generate(writer, [PREFIX + [7, 8, 9], second])
    writer.close()
    reader = make_core(kv_store_path=str(tmp_path))
    ((stored, stored_cached),) = generate(reader, [second])
    ((fresh, _),) = generate(make_core(enable_prefix_caching=False), [second])
    assert memory_cached == stored_cached == 64
    assert memory == stored == fresh
    stats = reader.stats()
    assert stats.store_hits == 4 and stats.store_errors == 0 and stats.prefix_hit_tokens == 64


def test_an_unusable_store_directory_fails_the_start_before_the_weights_load(
    make_core, tmp_path, monkeypatch
):
    not_a_directory = tmp_path / "kv"
    not_a_directory.write_text("a file, not a directory")

    def load_model(*args):
        raise AssertionError("the weights were loaded before the store directory was checked")

    monkeypatch.setattr(build, "load_model", load_model)
    with pytest.raises(FileExistsError):
        make_core(kv_store_path=str(not_a_directory))


def test_a_corrupt_block_in_the_store_is_recomputed(make_core, tmp_path):
    writer = make_core(kv_store_path=str(tmp_path))
    generate(writer, [PREFIX + [7, 8, 9]])
    writer.close()
    reader = make_core(kv_store_path=str(tmp_path))
    keys = reader.kv.keys(_probe(PREFIX), 4)
    corrupt_path = reader.kv.store.store.path_of(keys[2])
    expiry = corrupt_path.stat().st_mtime
    corrupt(corrupt_path)
    os.utime(corrupt_path, (expiry, expiry))
    ((tokens, cached),) = generate(reader, [PREFIX + [20]])
    ((fresh, _),) = generate(make_core(enable_prefix_caching=False), [PREFIX + [20]])
    assert cached == 32 and tokens == fresh
    assert reader.stats().store_errors == 1


def _probe(prompt: list[int]):
    from deepwell.engine.request import Request

    return Request("probe", prompt, GREEDY, frozenset(), torch.Generator())


WORKER = """
import json, sys
from deepwell.engine import EngineArgs, EngineCore, SamplingParams
core = EngineCore(EngineArgs(model=sys.argv[1], dtype="float32", block_size=16,
                             memory_gib=0.25, kv_store_path=sys.argv[2], num_threads=1))
core.add_request("r", json.loads(sys.argv[3]), SamplingParams(max_tokens=8, temperature=0))
tokens, cached = [], 0
while core.has_unfinished():
    for output in core.step():
        tokens += output.new_token_ids
        cached = output.num_cached_tokens
core.close()
print(json.dumps({"tokens": tokens, "cached": cached, "hits": core.stats().store_hits}))
"""


def test_a_second_worker_process_reuses_what_the_first_wrote(tiny_llama, tmp_path):
    def worker(prompt):
        done = subprocess.run(
            [sys.executable, "-c", WORKER, str(tiny_llama), str(tmp_path), json.dumps(prompt)],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = worker(PREFIX + [7])
    second = worker(PREFIX + [8])
    assert first["cached"] == 0 and first["hits"] == 0
    assert second["cached"] == 64 and second["hits"] == 4
