"""Asynchronous scheduling: the same tokens and logprobs as the synchronous loop, blocks kept
while a step computes, and a whole pool after any mix of stops, aborts and preemptions."""

import itertools
import json
import logging
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.speculative import cadence
from deepwell.engine.structured import StructuredOutput

from .structured.tiny_tokenizer import tiny_tokenizer
from .tiny_llama import TINY_CONFIG, run_to_completion

VOCAB = TINY_CONFIG["vocab_size"]
# Ids the random model emits now and then: requests stop early, mid-pipeline.
STOP_IDS = list(range(40, 52))
_ids = itertools.count()


def small_pool_args(tiny_llama, async_scheduling: bool) -> EngineArgs:
    # Batch invariance makes a request's logits independent of when and with whom it runs,
    # which is what differs between the two loops; 12 blocks of 16 tokens force preemption.
    return EngineArgs(
        model=str(tiny_llama),
        dtype="float32",
        block_size=16,
        num_kv_blocks=12,
        max_model_len=160,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        batch_invariant=True,
        async_scheduling=async_scheduling,
    )


@pytest.fixture(scope="module")
def cores(tiny_llama) -> dict[bool, EngineCore]:
    return {mode: EngineCore(small_pool_args(tiny_llama, mode)) for mode in (False, True)}


def params_for(kind: int, max_tokens: int, seed: int) -> SamplingParams:
    common = {"max_tokens": max_tokens, "seed": seed, "stop_token_ids": STOP_IDS}
    return [
        SamplingParams(temperature=0, **common),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, **common),
        SamplingParams(
            temperature=0.8,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.4,
            **common,
        ),
        SamplingParams(temperature=1.0, logprobs=True, top_logprobs=2, **common),
    ][kind]


events = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 70),  # prompt length
            st.integers(1, 50),  # max_tokens
            st.integers(0, 3),  # sampling kind
        ),
        st.tuples(st.just("step"), st.integers(1, 6)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    min_size=1,
    max_size=20,
)


def play(core: EngineCore, script, seed: int, run_id: int):
    """Run the script; the tokens and logprobs of every request, and those aborted."""
    produced: dict[str, tuple[list, list]] = {}
    added: list[str] = []
    aborted: set[str] = set()

    def record(outputs):
        for output in outputs:
            tokens, logprobs = produced.setdefault(output.request_id, ([], []))
            tokens += output.new_token_ids
            logprobs += output.new_logprobs

    for n, event in enumerate(script):
        if event[0] == "add":
            _, prompt_len, max_tokens, kind = event
            request_id = f"{run_id}-{n}"
            prompt = [(seed + 11 * i) % (VOCAB - 3) + 3 for i in range(prompt_len)]
            core.add_request(request_id, prompt, params_for(kind, max_tokens, seed + n))
            added.append(request_id)
        elif event[0] == "step":
            for _ in range(event[1]):
                record(core.step())
        elif added:
            request_id = added[event[1] % len(added)]
            if core.abort(request_id):
                aborted.add(request_id)
    while core.has_unfinished():
        record(core.step())
    pool = core.kv.block_pool
    assert pool.num_free == pool.num_blocks and pool.ref_counts == [0] * pool.num_blocks
    assert not core.scheduler.running and not core.scheduler.waiting and not core.requests
    return {rid: produced.get(rid, ([], [])) for rid in added}, aborted


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(script=events, seed=st.integers(0, 2**16))
def test_outputs_match_the_synchronous_loop_and_the_pool_ends_whole(cores, script, seed):
    run_id = next(_ids)
    sync, sync_aborted = play(cores[False], script, seed, run_id)
    overlapped, async_aborted = play(cores[True], script, seed, run_id)
    # An abort lands after however many tokens each loop had handed back by then.
    for request_id in sync.keys() - sync_aborted - async_aborted:
        assert overlapped[request_id] == sync[request_id], request_id


def test_a_step_hands_back_the_previous_steps_tokens_while_the_next_computes(cores):
    core = cores[True]
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    assert core.step() == []  # the prompt is computing
    first = core.step()
    assert [len(o.new_token_ids) for o in first] == [1] and core.pipeline.in_flight is not None
    request = core.requests["a"]
    # The step in flight computes the token just handed back and samples a pending one.
    assert request.num_pending_tokens == 1
    assert request.num_computed_tokens == request.num_tokens
    run_to_completion(core)


def test_an_aborted_request_keeps_its_blocks_until_its_step_is_done(cores):
    core = cores[True]
    pool = core.kv.block_pool
    core.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=20, temperature=0))
    core.step()
    held = pool.num_blocks - pool.num_free
    assert held == 3 and core.pipeline.in_flight is not None
    assert core.abort("a")
    # The prefill still writes those blocks: nothing is handed out before it is done.
    assert pool.num_blocks - pool.num_free == held
    outputs = run_to_completion(core)
    assert outputs == {"a": []} and pool.num_free == pool.num_blocks


def test_speculation_and_grammars_give_the_same_tokens_either_way(
    tiny_llama_with_tokenizer, monkeypatch
):
    # On the tiny vocabulary the drafter finds something every ~18 proposals; a shorter
    # lull before overlapping makes the loop switch between drafting and overlap here.
    monkeypatch.setattr(cadence, "_PROPOSALS_BEFORE_OVERLAP", 4)
    tokenizer = tiny_tokenizer()
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}}},
        "required": ["tags"],
    }
    repetitive = tokenizer.encode('{"tags": ["alpha", "alpha", "alpha", "alpha"]}').ids

    def generate(async_scheduling: bool) -> tuple[dict[str, list[int]], int]:
        core = EngineCore(
            EngineArgs(
                model=str(tiny_llama_with_tokenizer),
                dtype="float32",
                block_size=16,
                memory_gib=0.25,
                async_scheduling=async_scheduling,
            )
        )
        grammar = StructuredOutput("json_schema", json.dumps(schema))
        for seed in range(4):
            # Repetitive prompts draft at first; once they are done, long random runs find
            # no drafts and the loop overlaps.
            repeats = seed % 2
            core.add_request(
                f"free{seed}",
                repetitive * 3 if repeats else list(range(3 + seed, 60 + seed)),
                SamplingParams(
                    max_tokens=40 if repeats else 240,
                    temperature=0.7 if seed else 0.0,
                    seed=seed,
                ),
            )
            core.add_request(
                f"json{seed}",
                repetitive,
                SamplingParams(
                    max_tokens=40, temperature=0.7, seed=seed, structured_output=grammar
                ),
            )
        tokens = run_to_completion(core)
        return tokens, core.stats().spec.verified_tokens

    synchronous, _ = generate(False)
    overlapped, verified = generate(True)
    assert overlapped == synchronous
    assert verified > 0  # drafts still ran with the loop overlapping


# Runs in a process of its own: the torch thread count is process-wide, and libgomp's state
# after two threads outlives the test.
_THREADS_SCRIPT = """
import json, sys
from deepwell.engine import EngineArgs, EngineCore, SamplingParams
model, threads = sys.argv[1], int(sys.argv[2])
runs = {}
for mode in (None, False, True):
    core = EngineCore(EngineArgs(
        model=model, dtype="float32", block_size=16, memory_gib=0.25, batch_invariant=True,
        attention_backend="torch", num_threads=threads, async_scheduling=mode,
    ))
    for index, prompt in enumerate([[5, 6, 7, 8], [9, 10, 11], [12] * 20]):
        params = SamplingParams(max_tokens=10, temperature=index * 0.7, seed=index)
        core.add_request(str(index), prompt, params)
    tokens = {}
    while core.has_unfinished():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    runs[str(mode)] = [core.async_scheduling, tokens]
    core.close()
print(json.dumps(runs))
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_overlap_is_on_by_default_with_one_thread_only_and_changes_no_token(tiny_llama, threads):
    """docs/benchmarks.md, "asynchronous scheduling with DSpark": on a quiet CPU two
    threads run faster synchronously, so auto turns overlap off there; forced on, it still
    gives the same tokens."""
    out = subprocess.run(
        [sys.executable, "-c", _THREADS_SCRIPT, str(tiny_llama), str(threads)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    runs = json.loads(out.strip().splitlines()[-1])
    assert [runs[mode][0] for mode in ("None", "False", "True")] == [threads == 1, False, True]
    assert runs["None"][1] == runs["False"][1] == runs["True"][1]


def test_a_stats_line_is_logged_every_interval_of_steps(make_core, caplog):
    core = make_core(logging_interval_step=3, attention_backend="torch")
    core.add_request("r", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    with caplog.at_level(logging.INFO, logger="deepwell.engine.core"):
        run_to_completion(core)
    lines = [r.getMessage() for r in caplog.records if r.name == "deepwell.engine.core"]
    assert [line.split(":")[0] for line in lines] == ["step 3", "step 6"]
    assert "running 1" in lines[0]
