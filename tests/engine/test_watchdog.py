"""The step loop's invariant and watchdog: a request the loop lost track of, or stopped
scheduling, ends with an error its caller sees and gives its KV blocks back."""

import time

from deepwell.engine import SamplingParams
from deepwell.engine.outputs import FinishReason


def _step_until_idle(core, limit: int = 500) -> list:
    outputs = []
    for _ in range(limit):
        if not core.has_unfinished():
            return outputs
        outputs += core.step()
    raise AssertionError("the engine did not go idle")


def _blocks_used(core) -> int:
    stats = core.stats()
    return stats.kv_blocks_used


def test_request_held_by_the_scheduler_alone_is_ended_and_its_blocks_freed(make_core):
    core = make_core()
    core.add_request("lost", list(range(3, 40)), SamplingParams(max_tokens=50, temperature=0))
    core.step()
    assert _blocks_used(core) > 0
    # The stranded state of issue 32: the table lost the request, the scheduler still runs it.
    del core.requests["lost"]
    assert core.has_unfinished()
    outputs = _step_until_idle(core)
    ended = [o for o in outputs if o.request_id == "lost" and o.finished]
    assert [o.finish_reason for o in ended] == [FinishReason.STUCK]
    assert "missing from the engine's table" in ended[0].error
    assert _blocks_used(core) == 0
    assert core.stats().stuck_requests_ended == 1


def test_request_in_the_table_on_no_list_is_ended(make_core):
    core = make_core()
    core.add_request("orphan", list(range(3, 20)), SamplingParams(max_tokens=50, temperature=0))
    core.add_request("fine", list(range(3, 20)), SamplingParams(max_tokens=4, temperature=0))
    core.step()
    orphan = core.requests["orphan"]
    core.scheduler.running.remove(orphan)
    outputs = _step_until_idle(core)
    reasons = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert reasons == {"orphan": FinishReason.STUCK, "fine": FinishReason.LENGTH}
    assert _blocks_used(core) == 0


def test_running_request_not_scheduled_past_the_timeout_is_ended(make_core):
    core = make_core(stuck_request_timeout_s=30.0)
    core.add_request("slow", list(range(3, 20)), SamplingParams(max_tokens=50, temperature=0))
    core.step()
    core.requests["slow"].last_scheduled = time.monotonic() - 31.0
    outputs = _step_until_idle(core)
    ended = [o for o in outputs if o.finished]
    assert [o.finish_reason for o in ended] == [FinishReason.STUCK]
    assert "not scheduled for 31 s" in ended[0].error
    assert _blocks_used(core) == 0


def test_watchdog_leaves_progressing_requests_alone(make_core):
    core = make_core(stuck_request_timeout_s=0.05)
    for index in range(4):
        prompt = list(range(3 + index, 30 + index))
        core.add_request(f"r{index}", prompt, SamplingParams(max_tokens=12, temperature=0))
    outputs = _step_until_idle(core)
    reasons = [o.finish_reason for o in outputs if o.finished]
    assert reasons == [FinishReason.LENGTH] * 4
    assert core.stats().stuck_requests_ended == 0


def test_requests_the_budget_runs_out_before_are_not_stuck(make_core):
    # Four decoding requests and a budget of 4 tokens: the oldest one's draft takes the
    # whole step, the three behind it wait on that progress and must not be ended.
    core = make_core(
        stuck_request_timeout_s=30.0,
        max_num_batched_tokens=4,
        async_scheduling=False,
        num_speculative_tokens=0,
    )
    for index in range(4):
        core.add_request(f"r{index}", [3 + index], SamplingParams(max_tokens=8, temperature=0))
    core.step()
    first, *behind = core.scheduler.running
    first.draft_token_ids = [5, 5, 5]
    computed = [r.num_computed_tokens for r in behind]
    before = time.monotonic()
    core.step()
    first.draft_token_ids = []
    # Passed over (nothing computed), yet their clocks read this step.
    assert [r.num_computed_tokens for r in behind] == computed
    assert all(r.last_scheduled >= before for r in behind)
    outputs = _step_until_idle(core)
    assert [o.finish_reason for o in outputs if o.finished] == [FinishReason.LENGTH] * 4
    assert core.stats().stuck_requests_ended == 0
