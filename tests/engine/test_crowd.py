"""Crowds against the step loop: requests arriving at random steps, with prefix sharing,
preemption, drafts and aborts, in every scheduling mode; every request must finish, the
watchdog must never fire, and no KV block may stay held."""

import random
import time

import pytest

from deepwell.engine import SamplingParams

MODES = [
    pytest.param(
        invariant,
        overlap,
        id=f"{'invariant' if invariant else 'default'}-{'async' if overlap else 'sync'}",
    )
    for invariant in (True, False)
    for overlap in (True, False)
]
# Few blocks and a short context: crowds preempt.
_CROWD_ARGS = {
    "num_kv_blocks": 9,
    "max_model_len": 128,
    "max_num_batched_tokens": 64,
    "speculative_method": "ngram",
    "num_speculative_tokens": 4,
}


def _prompt(rng: random.Random) -> list[int]:
    length = rng.randint(1, 60)
    if rng.random() < 0.5:
        return [rng.randrange(3, 320) for _ in range(length)]
    # Repetitive text: shared prefixes, and drafts for the n-gram drafter.
    return ([5, 6, 7] * length)[:length]


def run_crowd(core, seconds: float, seed: int) -> int:
    """Send crowds until `seconds` pass; returns the requests finished. Fails on a request
    left unfinished, a watchdog kill or a block still held."""
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    open_ids: set[str] = set()
    arrivals: list[tuple[int, str, list[int], SamplingParams]] = []
    finished = step = idle_steps = 0
    while time.monotonic() < deadline or arrivals or open_ids:
        if not arrivals and not open_ids and time.monotonic() < deadline:
            crowd = rng.randint(1, 12)
            for index in range(crowd):
                params = SamplingParams(
                    max_tokens=rng.randint(1, 50), temperature=rng.choice([0.0, 1.0]), seed=index
                )
                arrivals.append(
                    (step + rng.randint(0, 20), f"{step}-{index}", _prompt(rng), params)
                )
            arrivals.sort(key=lambda arrival: arrival[0])
        while arrivals and arrivals[0][0] <= step:
            _, request_id, prompt, params = arrivals.pop(0)
            core.add_request(request_id, prompt, params)
            open_ids.add(request_id)
        if open_ids and rng.random() < 0.02:
            core.abort(rng.choice(sorted(open_ids)))
        outputs = core.step() if core.has_unfinished() else []
        for output in outputs:
            if output.finished:
                open_ids.discard(output.request_id)
                finished += 1
        idle_steps = 0 if outputs or arrivals else idle_steps + 1
        assert idle_steps < 1000, f"stranded: {sorted(open_ids)}, {core.stats()}"
        step += 1
    stats = core.stats()
    assert stats.stuck_requests_ended == 0
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert not core.has_unfinished()
    return finished


@pytest.mark.parametrize(("batch_invariant", "async_scheduling"), MODES)
def test_every_crowd_request_finishes(make_core, batch_invariant, async_scheduling):
    core = make_core(
        batch_invariant=batch_invariant, async_scheduling=async_scheduling, **_CROWD_ARGS
    )
    assert run_crowd(core, seconds=1.5, seed=7) > 0
    core.close()


@pytest.mark.slow
@pytest.mark.parametrize(("batch_invariant", "async_scheduling"), MODES)
def test_every_crowd_request_finishes_for_ten_minutes(make_core, batch_invariant, async_scheduling):
    core = make_core(
        batch_invariant=batch_invariant, async_scheduling=async_scheduling, **_CROWD_ARGS
    )
    assert run_crowd(core, seconds=600.0, seed=11) > 0
    core.close()
