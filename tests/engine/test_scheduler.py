"""Scheduler: token budget, chunked prefill, max_num_seqs, running before waiting."""

import torch

from deepwell.engine import SamplingParams
from deepwell.engine.kv.layout import KVLayout, PagedSpec
from deepwell.engine.kv.manager import KVCacheManager
from deepwell.engine.request import Request, RequestStatus
from deepwell.engine.scheduler import Scheduler

LAYOUT = KVLayout(paged=(PagedSpec("key", 1, (1, 4), entry_axis=1),))


def make(num_blocks=64, max_num_seqs=8, budget=16) -> Scheduler:
    return Scheduler(KVCacheManager(LAYOUT, num_blocks, 4, 1), max_num_seqs, budget)


def request(name: str, num_tokens: int) -> Request:
    return Request(
        name, [5] * num_tokens, SamplingParams(max_tokens=4), frozenset(), torch.Generator()
    )


def run(scheduler: Scheduler):
    """Schedule one step and pretend it ran (completing chunks sample a token)."""
    plan = scheduler.schedule()
    for chunk in plan.chunks:
        if chunk.completes:
            chunk.request.token_ids.append(7)
            chunk.request.num_pending_tokens -= 1
    return plan


def test_long_prompt_is_prefilled_in_budget_sized_chunks():
    scheduler = make(budget=16)
    long = request("long", 40)
    scheduler.add(long)
    sizes = [run(scheduler).chunks[0].num_tokens for _ in range(3)]
    assert sizes == [16, 16, 8]
    assert long.num_output_tokens == 1


def test_running_requests_come_before_waiting_ones_and_share_the_budget():
    scheduler = make(budget=16)
    a = request("a", 10)
    scheduler.add(a)
    run(scheduler)
    b = request("b", 30)
    scheduler.add(b)
    plan = run(scheduler)
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 15)]
    assert plan.num_tokens == 16


def test_max_num_seqs_caps_running_requests():
    scheduler = make(max_num_seqs=2)
    for name in "abc":
        scheduler.add(request(name, 3))
    plan = run(scheduler)
    assert {c.request.request_id for c in plan.chunks} == {"a", "b"}
    assert scheduler.waiting[0].request_id == "c"


def test_out_of_blocks_preempts_the_newest_and_it_restarts_from_zero():
    scheduler = make(num_blocks=4, budget=64)
    old, new = request("old", 8), request("new", 7)
    scheduler.add(old)
    scheduler.add(new)
    run(scheduler)  # old: 2 blocks, new: 2 blocks, pool empty
    old.token_ids += [7]  # old grows past its blocks and needs a third
    plan = run(scheduler)
    assert plan.preempted == [new]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert new.block_ids == [] and new.num_preemptions == 1


def test_a_draft_is_cut_to_the_budget_left_or_waits_whole_when_batch_invariant():
    def draft_lengths(whole_drafts: bool) -> list[list[int]]:
        scheduler = Scheduler(KVCacheManager(LAYOUT, 64, 4, 1), 8, 8, whole_drafts)
        a, b = request("a", 3), request("b", 3)
        for r in (a, b):
            scheduler.add(r)
        run(scheduler)  # both prompts
        a.draft_token_ids, b.draft_token_ids = [1, 2, 3], [4, 5, 6, 7]
        lengths = []
        for _ in range(2):
            plan = run(scheduler)
            lengths.append([len(c.draft) for c in plan.chunks])
            b.draft_token_ids = [4, 5, 6, 7]
            a.draft_token_ids = []
        return lengths

    # a takes 4 of the 8 tokens; b's 1 + 4 do not fit the 4 left: cut to 3, or b waits a
    # step and then verifies all 4.
    assert draft_lengths(False)[0] == [3, 3]
    assert draft_lengths(True) == [[3], [0, 4]]


def test_prefill_chunks_together_stay_under_the_key_cap():
    # DeepInfer's PREFILL_MAX_SUM_SEQLEN_K: each chunk counts its start plus its tokens.
    scheduler = Scheduler(KVCacheManager(LAYOUT, 64, 4, 1), 8, 128, max_prefill_keys=40)
    for name in "ab":
        scheduler.add(request(name, 30))
    plan = run(scheduler)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks] == [
        ("a", 0, 30),
        ("b", 0, 10),
    ]
    # a decodes (not a prefill); b's next chunk covers keys 0..30.
    plan = run(scheduler)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks] == [
        ("a", 30, 1),
        ("b", 10, 20),
    ]


def test_a_prompt_longer_than_the_key_cap_still_prefills_alone():
    scheduler = Scheduler(KVCacheManager(LAYOUT, 64, 4, 1), 8, 64, max_prefill_keys=16)
    scheduler.add(request("long", 100))
    scheduler.add(request("short", 4))
    plan = run(scheduler)
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("long", 64)]
    plan = run(scheduler)
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("long", 36)]


def test_without_chunked_prefill_a_prompt_waits_for_room_for_all_of_it():
    chunked = make(budget=16)
    whole = Scheduler(KVCacheManager(LAYOUT, 64, 4, 1), 8, 16, chunked_prefill=False)
    for scheduler in (chunked, whole):
        scheduler.add(request("a", 10))
        scheduler.add(request("b", 10))
    assert [c.num_tokens for c in run(chunked).chunks] == [10, 6]
    assert [c.num_tokens for c in run(whole).chunks] == [10]
    # The next step: a decodes, b's whole prompt fits beside it.
    assert [c.num_tokens for c in run(whole).chunks] == [1, 10]
