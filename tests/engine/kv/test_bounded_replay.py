"""Prefix hits on DeepSeek-V4.1: ring snapshots at block boundaries (memory and KV store)
and SWA bounded replay (modes off / mask / compact), against no cache in the same mode."""

import itertools
import os

import pytest
import torch

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.kv.replay import BoundedReplay
from deepwell.engine.kv.snapshots import RingSnapshots, SnapshotPart
from deepwell.engine.kv.store import HEADER, SNAPSHOT_SUFFIX
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint
from deepwell.engine.request import Request

# The tiny config's window is 8 with 6 backtracking rows: 14 is the least keep allowed.
KEEP = 20
ANSWER = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
_ids = itertools.count()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=0).path


@pytest.fixture(scope="module")
def make_core(checkpoint):
    def make(mode: str = "off", **kwargs) -> EngineCore:
        defaults = dict(
            model=str(checkpoint),
            dtype="float32",
            quantize_kv_cache=False,
            max_model_len=256,
            block_size=16,
            memory_gib=0.5,
            # Prefills in chunks of 20: snapshots only where a chunk or decode crosses a
            # boundary, so hits land on those.
            max_num_batched_tokens=20,
            yoco_prefill_truncation_mode=mode,
            yoco_prefill_keep_tokens=KEEP,
        )
        return EngineCore(EngineArgs(**(defaults | kwargs)))

    return make


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=generator).tolist()


def generate(core: EngineCore, tokens: list[int]) -> tuple[int, list[int], list[float]]:
    """(prompt tokens taken from the cache, tokens, their logprobs) of one request."""
    core.add_request(f"r{next(_ids)}", tokens, ANSWER)
    cached, logprobs = 0, []
    while core.has_unfinished():
        for output in core.step():
            logprobs += output.new_logprobs
            cached = output.num_cached_tokens
    return cached, [lp.token_id for lp in logprobs], [lp.logprob for lp in logprobs]


def second_turn(core: EngineCore, first: list[int], extra: int) -> list[int]:
    """Run the first turn; the second turn's prompt is its prompt, answer and `extra` more."""
    _, answer, _ = generate(core, first)
    return first + answer + prompt(extra, seed=len(first) + 1000)


@pytest.fixture(scope="module")
def exact_cores(make_core):
    return make_core(), make_core(enable_prefix_caching=False)


# (first turn's prompt length, tokens added after its 8-token answer, expected hit): prompts
# ending before, on and after block (16) and window (8) edges. A hit lands on the last
# boundary a chunk or decode crossed with a snapshot there.
EXACT_CASES = [(7, 2, 0), (16, 1, 16), (23, 9, 16), (30, 1, 32), (33, 14, 32), (47, 6, 48)]


@pytest.mark.parametrize(("first_len", "extra", "expected_hit"), EXACT_CASES)
def test_exact_mode_hits_match_no_cache(exact_cores, first_len, extra, expected_hit):
    cached_core, fresh_core = exact_cores
    second = second_turn(cached_core, prompt(first_len, seed=first_len), extra)
    cached, tokens, logprobs = generate(cached_core, second)
    _, fresh_tokens, fresh_logprobs = generate(fresh_core, second)
    assert cached == expected_hit
    assert tokens == fresh_tokens
    assert logprobs == pytest.approx(fresh_logprobs, abs=1e-5)


def test_exact_mode_hits_from_the_kv_store_match_no_cache(make_core, exact_cores, tmp_path):
    writer = make_core(kv_store_path=str(tmp_path))
    second = second_turn(writer, prompt(47, seed=7), 6)
    writer.close()
    reader = make_core(kv_store_path=str(tmp_path))
    cached, tokens, logprobs = generate(reader, second)
    _, fresh_tokens, fresh_logprobs = generate(exact_cores[1], second)
    assert cached == 48
    assert tokens == fresh_tokens
    assert logprobs == pytest.approx(fresh_logprobs, abs=1e-5)
    stats = reader.stats()
    assert stats.store_hits == 3 + 1 and stats.store_errors == 0  # 3 blocks, 1 snapshot
    reader.close()


def test_a_corrupt_snapshot_in_the_store_is_counted_deleted_and_recomputed(
    make_core, exact_cores, tmp_path
):
    writer = make_core(kv_store_path=str(tmp_path))
    second = second_turn(writer, prompt(47, seed=8), 6)
    writer.close()
    snapshots = sorted(tmp_path.rglob(f"*{SNAPSHOT_SUFFIX}"))
    assert len(snapshots) == 3  # boundaries 16, 32 (prefill chunks) and 48 (a decode)
    for path in snapshots:
        expiry = path.stat().st_mtime
        data = bytearray(path.read_bytes())
        data[HEADER.size + 5] ^= 0xFF
        path.write_bytes(bytes(data))
        os.utime(path, (expiry, expiry))
    reader = make_core(kv_store_path=str(tmp_path))
    cached, tokens, logprobs = generate(reader, second)
    _, fresh_tokens, fresh_logprobs = generate(exact_cores[1], second)
    # Every snapshot the hit could use is corrupt: no hit, the whole prompt recomputed.
    assert cached == 0
    assert tokens == fresh_tokens
    assert logprobs == pytest.approx(fresh_logprobs, abs=1e-5)
    assert reader.stats().store_errors == 3  # boundaries 48, 32, 16, best first
    reader.close()


def test_exact_mode_without_restoring_the_rings_gives_other_outputs(
    exact_cores, make_core, monkeypatch
):
    """The control: a hit whose rings are not restored reads another sequence's rows."""
    monkeypatch.setattr(RingSnapshots, "restore", lambda self, cache, slot, boundary, t: None)
    core = make_core()
    second = second_turn(core, prompt(47, seed=9), 6)
    generate(core, prompt(60, seed=10))  # another sequence fills the ring slot
    cached, _, logprobs = generate(core, second)
    _, _, fresh_logprobs = generate(exact_cores[1], second)
    assert cached == 48
    assert logprobs[0] != pytest.approx(fresh_logprobs[0], abs=1e-3)


# (first turn's prompt length, tokens added after its answer, expected hit): the hit stops
# at the last snapshotted boundary at or before len(second) - KEEP. A first turn of 40 + 8
# never feeds position 47, so only 41 and more crosses 48.
BOUNDED_CASES = [(41, 30, 48), (40, 30, 32), (41, 5, 32), (20, 3, 0)]


@pytest.mark.parametrize("mode", ["mask", "compact"])
@pytest.mark.parametrize(("first_len", "extra", "expected_hit"), BOUNDED_CASES)
def test_bounded_modes_hit_before_the_replayed_suffix_and_match_no_cache(
    make_core, mode, first_len, extra, expected_hit
):
    core = make_core(mode)
    second = second_turn(core, prompt(first_len, seed=first_len + extra), extra)
    generate(core, prompt(60, seed=11))  # another sequence fills the ring slot
    cached, tokens, logprobs = generate(core, second)
    _, fresh_tokens, fresh_logprobs = generate(make_core(mode, enable_prefix_caching=False), second)
    assert cached == expected_hit
    assert cached <= len(second) - KEEP
    assert tokens == fresh_tokens
    assert logprobs == pytest.approx(fresh_logprobs, abs=1e-5)


def test_mask_and_compact_give_the_same_tokens_and_differ_from_exact(make_core):
    cores = {
        mode: make_core(mode, enable_prefix_caching=False) for mode in ("off", "mask", "compact")
    }
    drift = 0.0
    for seed in range(4):
        tokens = prompt(40 + 9 * seed, seed=100 + seed)
        results = {mode: generate(core, tokens) for mode, core in cores.items()}
        assert results["mask"][1] == results["compact"][1]
        assert results["mask"][2] == pytest.approx(results["compact"][2], abs=1e-4)
        drift = max(drift, abs(results["mask"][2][0] - results["off"][2][0]))
    # Prompts longer than the keep: the consumers' window really is bounded.
    assert drift > 1e-4


def test_a_hit_past_the_replay_start_gives_other_outputs(make_core, monkeypatch):
    """The control: hitting closer than KEEP to the end leaves the consumer layers' rings
    (never restored) holding another sequence's rows."""
    monkeypatch.setattr(BoundedReplay, "hit_limit", lambda self, num_tokens: num_tokens - 1)
    core = make_core("mask")
    second = second_turn(core, prompt(41, seed=12), 5)
    generate(core, prompt(60, seed=13))
    cached, _, logprobs = generate(core, second)
    monkeypatch.undo()
    _, _, fresh_logprobs = generate(make_core("mask", enable_prefix_caching=False), second)
    assert cached == 48 > len(second) - KEEP
    assert logprobs != pytest.approx(fresh_logprobs, abs=1e-3)


def test_a_keep_smaller_than_window_plus_backtracking_is_refused(make_core):
    with pytest.raises(ValueError, match="at least the window plus the backtracking rows"):
        make_core("mask", yoco_prefill_keep_tokens=13)


def test_a_truncation_mode_on_a_model_without_yoco_layers_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="no YOCO consumer layers|has none"):
        EngineCore(EngineArgs(model=str(tiny_llama), yoco_prefill_truncation_mode="compact"))


def test_an_unknown_truncation_mode_is_refused():
    with pytest.raises(ValueError, match="yoco_prefill_truncation_mode must be one of"):
        EngineArgs(yoco_prefill_truncation_mode="trim")


def test_the_environment_sets_the_truncation_switches(monkeypatch):
    monkeypatch.setenv("DEEPWELL_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    monkeypatch.setenv("DEEPWELL_YOCO_PREFILL_KEEP_TOKENS", "150")
    args = EngineArgs()
    assert (args.yoco_prefill_truncation_mode, args.yoco_prefill_keep_tokens) == ("compact", 150)


def test_snapshots_beyond_capacity_evict_the_least_recently_used():
    part = SnapshotPart("window", 0, 2, (3,), torch.float32)
    snapshots = RingSnapshots([part], capacity=2)
    for n in range(3):
        if n == 2:
            snapshots.get(b"0")  # used: survives the next insertion
        snapshots.put(str(n).encode(), [torch.full((2, 3), float(n))])
    assert len(snapshots) == 2
    assert snapshots.get(b"1") is None and snapshots.get(b"0") is not None
    assert snapshots.snapshot_bytes == 2 * 3 * 4


@pytest.mark.parametrize("mode", ["mask", "compact"])
def test_a_repeated_prompt_hits_at_its_replay_start_boundary(make_core, mode):
    """One chunk would cross 32 and 48 and snapshot only 48, past the replay start (40):
    the chunk is cut at 32, so the repeat hits there."""
    core = make_core(mode, max_num_batched_tokens=256)
    tokens = prompt(60, seed=14)
    first = generate(core, tokens)
    cached, repeat_tokens, repeat_logprobs = generate(core, tokens)
    assert first[0] == 0 and cached == 32
    assert repeat_tokens == first[1]
    assert repeat_logprobs == pytest.approx(first[2], abs=1e-5)


def test_a_snapshot_leaves_memory_with_its_block(make_core):
    core = make_core(num_kv_blocks=16, max_model_len=256)
    first = prompt(47, seed=15)
    _, answer, _ = generate(core, first)
    probe = Request("probe", first + answer, ANSWER, frozenset(), torch.Generator())
    keys = core.kv.keys(probe, 3)
    assert all(core.kv.snapshots.get(key) is not None for key in keys)  # 16, 32, 48
    generate(core, prompt(240, seed=16))  # takes all 16 blocks: the cached ones go
    assert all(core.kv.snapshots.get(key) is None for key in keys)


@pytest.mark.parametrize("mode", ["off", "mask", "compact"])
def test_concurrent_hits_in_mixed_steps_match_no_cache(make_core, mode):
    """Four follow-ups of one conversation, admitted together: hits, chunked prefills and
    decodes share steps."""
    core = make_core(mode, max_num_batched_tokens=40)
    second = second_turn(core, prompt(41, seed=17), 0)
    follow_ups = [second + prompt(24 + 3 * n, seed=20 + n) for n in range(4)]
    for n, tokens in enumerate(follow_ups):
        core.add_request(f"f{n}", tokens, ANSWER)
    outputs: dict[str, list[float]] = {}
    cached: dict[str, int] = {}
    while core.has_unfinished():
        for output in core.step():
            outputs.setdefault(output.request_id, []).extend(
                lp.logprob for lp in output.new_logprobs
            )
            cached[output.request_id] = output.num_cached_tokens
    fresh = make_core(mode, enable_prefix_caching=False)
    for n, tokens in enumerate(follow_ups):
        _, _, expected = generate(fresh, tokens)
        assert cached[f"f{n}"] >= 32
        assert outputs[f"f{n}"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("mode", ["off", "mask", "compact"])
def test_hits_with_dspark_drafting_match_no_cache(make_core, mode):
    """DSpark's context rings are fed by consumer layers: a hit restores them from the
    snapshot (off) or rebuilds them in the replayed suffix (mask, compact, where compact
    feeds them only the kept rows); greedy tokens stay those of no cache."""
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    cores = [
        make_core(mode, num_speculative_tokens=3, **cache)
        for cache in ({}, {"enable_prefix_caching": False})
    ]
    outputs = []
    for core in cores:
        assert core.speculator is not None
        first = prompt(40, seed=40)
        for tokens in (first, first + prompt(30, seed=41)):
            core.add_request(f"r{next(_ids)}", tokens, greedy)
            out, cached = [], 0
            while core.has_unfinished():
                for output in core.step():
                    out += output.new_token_ids
                    cached = output.num_cached_tokens
        outputs.append((cached, out))
        assert core.stats().spec.verified_tokens > 0
    (cached, tokens), (fresh_cached, fresh_tokens) = outputs
    assert cached > 0 and fresh_cached == 0
    assert tokens == fresh_tokens
