"""Asynchronous scheduling and structured output on the tiny DeepSeek-V4.1: the overlapped
loop gives the synchronous loop's tokens and logprobs (rings, compressor tails and Engram
history included), and constrained requests match their grammars either way."""

import json
import random
import re

import jsonschema
import pytest
import torch

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint
from deepwell.engine.scheduler import ScheduledChunk
from deepwell.engine.structured import StructuredOutput


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=0).path


def make_core(checkpoint, **kwargs) -> EngineCore:
    args = dict(
        model=str(checkpoint),
        dtype="float32",
        max_model_len=512,
        block_size=16,
        memory_gib=0.5,
        max_num_batched_tokens=48,
    )
    return EngineCore(EngineArgs(**(args | kwargs)))


@pytest.fixture(scope="module")
def cores(checkpoint) -> dict[bool, EngineCore]:
    # Batch-invariant: the two loops batch requests differently, and a request's logits
    # must not follow its neighbours for the tokens to be comparable bit for bit. No
    # speculation: in batch-invariant mode it looks for drafts every step, so steps never
    # overlap (docs/engine.md).
    return {
        mode: make_core(
            checkpoint, batch_invariant=True, async_scheduling=mode, num_speculative_tokens=0
        )
        for mode in (False, True)
    }


def generate(core: EngineCore, requests) -> dict[str, tuple[list[int], list]]:
    for request_id, prompt, params in requests:
        core.add_request(request_id, prompt, params)
    out: dict[str, tuple[list[int], list]] = {}
    while core.has_unfinished():
        for output in core.step():
            tokens, logprobs = out.setdefault(output.request_id, ([], []))
            tokens += output.new_token_ids
            logprobs += output.new_logprobs
    return out


def test_the_loop_overlaps_on_v41(cores):
    assert torch.get_num_threads() == 1
    core = cores[True]
    assert core.async_scheduling
    core.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0))
    assert core.step() == []  # the prompt is computing
    first = core.step()
    # Step N's token comes back while step N+1, whose input it is, computes.
    assert [len(o.new_token_ids) for o in first] == [1] and core.pipeline.in_flight is not None
    assert core.requests["a"].num_pending_tokens == 1
    generate(core, [])


def test_async_tokens_and_logprobs_equal_the_synchronous_loops(cores, monkeypatch):
    rng = random.Random(0)
    requests = []
    for n in range(12):
        # Prompts across the window (8), the compress ratios and the Engram depth (2).
        prompt = [rng.randrange(3, 276) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 24),
            temperature=[0.0, 1.0][n % 2],
            seed=n,
            ignore_eos=True,
            logprobs=n % 3 == 0,
        )
        requests.append((f"r{n}", prompt, params))
    runner = cores[True].runner
    pending_rows = []
    forward = runner.forward

    def recording_forward(step, pending):
        pending_rows.append(len(step.pending_rows))
        return forward(step, pending)

    monkeypatch.setattr(runner, "forward", recording_forward)
    overlapped = generate(cores[True], requests)
    synchronous = generate(cores[False], requests)
    assert overlapped == synchronous
    # Steps took inputs sampled by the step before them, filled in at launch. (A pending
    # token enters another row's Engram history only in a verify chunk, once speculation
    # runs on V4.1; the next step's history holds it committed.)
    assert sum(pending_rows) > 0


def test_a_pending_token_in_a_verify_chunks_engram_history_is_filled_in_at_launch(cores):
    """A verify chunk whose first input is still being sampled (asynchronous scheduling with
    drafts): its draft rows carry that token in their Engram history, filled in at launch,
    and their logits are bitwise those of the same chunk prepared with the token known."""
    core = cores[False]
    runner = core.runner
    core.add_request("v", [5, 6, 7, 8, 9], SamplingParams(max_tokens=2, temperature=0))
    core.step()
    request = core.requests["v"]
    (sampled,) = request.token_ids[5:]
    chunk = ScheduledChunk(request, 5, 1, True, draft=[40, 41])
    known = runner.prepare([chunk])
    request.token_ids.pop()  # as while the step before still samples it
    pending = runner.prepare([chunk])
    request.token_ids.append(sampled)
    # Rows 1 and 2 (the draft) hold the pending token one and two positions back.
    assert [(row, column) for row, column, _ in pending.pending_history] == [(1, 0), (2, 1)]
    known_logits = runner.forward(known, {})
    pending_logits = runner.forward(pending, {"v": sampled})
    assert torch.equal(pending.meta.token_history, known.meta.token_history)
    assert torch.equal(pending_logits, known_logits)
    core.abort("v")
    generate(core, [])


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    ("json_schema", json.dumps(SCHEMA)),
    ("regex", r"[0-9]{3}-[a-z]{2,5}"),
    ("ebnf", 'start: item ("," item)*\nitem: "yes" | "no" | /[0-9]/'),
]


def check(kind: str, spec: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(spec, text), text
    else:
        assert re.fullmatch(r"(yes|no|[0-9])(,(yes|no|[0-9]))*", text.removesuffix(",")), text


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constrained_output_matches_its_grammar(checkpoint, async_scheduling):
    core = make_core(checkpoint, async_scheduling=async_scheduling)
    tokenizer = core.tokenizer
    prompt = tokenizer.encode("answer:").ids
    requests = []
    for seed in range(2):
        for kind, spec in CONSTRAINTS:
            params = SamplingParams(
                max_tokens=80,
                temperature=1.0,
                seed=seed,
                structured_output=StructuredOutput(kind, spec),
            )
            requests.append((f"{kind}-{seed}", prompt, params))
    # Unconstrained neighbours share the steps with the constrained ones.
    requests += [
        (f"free-{n}", prompt, SamplingParams(max_tokens=20, ignore_eos=True)) for n in range(2)
    ]
    outputs = generate(core, requests)
    eos = set(core.eos_token_ids)
    for request_id, _, params in requests:
        if params.structured_output is None:
            continue
        tokens = [t for t in outputs[request_id][0] if t not in eos]
        check(
            params.structured_output.kind, params.structured_output.spec, tokenizer.decode(tokens)
        )
