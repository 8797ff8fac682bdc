"""Structured output through EngineCore: constrained outputs, triggers, errors, no stalls."""

import json
import re

import jsonschema
import pytest

from deepwell.engine import FinishReason, SamplingParams
from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.structured import StructuredOutput

from ..tiny_llama import run_to_completion
from .schemas import heavy_schema
from .tiny_tokenizer import tiny_tokenizer

TOKENIZER = tiny_tokenizer()
PROMPT = TOKENIZER.encode("answer:").ids


def constrained(kind: str, spec: str, **kwargs) -> SamplingParams:
    options = {"max_tokens": 120, "temperature": 1.0, "seed": 7} | kwargs
    return SamplingParams(structured_output=StructuredOutput(kind, spec), **options)


def run_one(core, params: SamplingParams) -> str:
    core.add_request("r", PROMPT, params)
    tokens = run_to_completion(core)["r"]
    return TOKENIZER.decode([t for t in tokens if t != 2])


def test_json_schema_output_validates(make_core):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "tags", "n"],
        "additionalProperties": False,
    }
    core = make_core()
    for seed in range(3):
        text = run_one(core, constrained("json_schema", json.dumps(schema), seed=seed))
        jsonschema.validate(json.loads(text), schema)


def test_json_object_output_is_an_object(make_core):
    core = make_core()
    text = run_one(
        core,
        SamplingParams(
            max_tokens=40, temperature=0, structured_output=StructuredOutput("json_object")
        ),
    )
    # A random model may run out of tokens inside the object; what it wrote is a prefix.
    assert text.startswith("{")


def test_regex_output_matches(make_core):
    core = make_core()
    text = run_one(core, constrained("regex", r"[0-9]{3}-[a-z]{2,5}"))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text)


def test_ebnf_output_matches(make_core):
    grammar = 'start: item ("," item)*\nitem: "yes" | "no" | /[0-9]/'
    core = make_core()
    text = run_one(core, constrained("ebnf", grammar, max_tokens=40, ignore_eos=False))
    assert re.fullmatch(r"(yes|no|[0-9])(,(yes|no|[0-9]))*", text.removesuffix(","))


def test_grammar_starts_after_the_trigger_sequence(make_core):
    core = make_core()
    core.add_request("free", PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    free = run_to_completion(core)["free"]
    # Greedy and unconstrained, the model writes free[:2] first: make that the trigger.
    trigger = tuple(free[:2])
    params = SamplingParams(
        max_tokens=20,
        temperature=0,
        structured_output=StructuredOutput("regex", "[0-9]{4}", trigger_token_ids=trigger),
    )
    core.add_request("triggered", PROMPT, params)
    tokens = run_to_completion(core)["triggered"]
    assert tokens[:2] == list(trigger)
    assert re.fullmatch("[0-9]{4}", TOKENIZER.decode([t for t in tokens[2:] if t != 2]))


def test_invalid_grammar_ends_only_its_request(make_core):
    core = make_core()
    core.add_request("bad", PROMPT, constrained("regex", "[a-z"))
    core.add_request("good", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    finished = {}
    while core.has_unfinished():
        for output in core.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished["bad"].finish_reason is FinishReason.ERROR
    assert "unclosed character class" in finished["bad"].error
    assert finished["good"].finish_reason is FinishReason.LENGTH
    assert finished["good"].num_output_tokens == 5


def test_compile_timeout_ends_the_request_with_an_error(make_core):
    core = make_core(grammar_compile_timeout_s=0.05)
    core.add_request("heavy", PROMPT, constrained("json_schema", json.dumps(heavy_schema())))
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    assert outputs[-1].finish_reason is FinishReason.ERROR
    assert "took longer than 0.05 s" in outputs[-1].error


def test_step_loop_keeps_stepping_while_a_large_grammar_compiles(make_core):
    core = make_core()
    core.add_request("free", PROMPT, SamplingParams(max_tokens=480, ignore_eos=True))
    core.add_request("heavy", PROMPT, constrained("json_schema", json.dumps(heavy_schema())))
    steps_while_compiling = tokens_while_compiling = 0
    while "heavy" in core.intake.compiling and "free" in core.requests:
        outputs = core.step()
        tokens_while_compiling += sum(
            len(o.new_token_ids) for o in outputs if o.request_id == "free"
        )
        steps_while_compiling += 1
    # The compile takes ~1 s; the other request got a token every step meanwhile (with
    # asynchronous scheduling a step's token comes back with the step after it).
    assert steps_while_compiling > 10
    assert tokens_while_compiling >= steps_while_compiling - 1
    core.abort("heavy")
    core.abort("free")
    run_to_completion(core)


def test_abort_while_compiling_frees_the_request(make_core):
    core = make_core()
    core.add_request("heavy", PROMPT, constrained("json_schema", json.dumps(heavy_schema())))
    assert core.abort("heavy")
    outputs = run_to_completion(core)
    assert outputs == {"heavy": []}
    assert not core.has_unfinished()


def test_a_resumed_constrained_request_goes_on_where_it_stopped(make_core):
    """Serve's failover: the output so far joins the prompt and the grammar replays it, so
    the seeded continuation writes the same tail the undisturbed request wrote. Batch
    invariant, as failover's identity is: the resumed prompt's prefill then gives the logits
    the original's decode steps had, on every CPU kind (not only up to the first near-tie)."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    spec = json.dumps(schema)
    core = make_core(batch_invariant=True)
    core.add_request("whole", PROMPT, constrained("json_schema", spec))
    whole = run_to_completion(core)["whole"]
    assert len(whole) > 6
    cut = len(whole) // 2
    resumed = constrained(
        "json_schema",
        spec,
        max_tokens=120 - cut,
        grammar_replay_token_ids=tuple(whole[:cut]),
    )
    core.add_request("tail", PROMPT + whole[:cut], resumed)
    tail = run_to_completion(core)["tail"]
    assert whole[:cut] + tail == whole
    jsonschema.validate(json.loads(TOKENIZER.decode([t for t in whole if t != 2])), schema)


def test_a_resumed_output_outside_its_grammar_ends_with_an_error(make_core):
    core = make_core()
    letters = tuple(TOKENIZER.encode("abc").ids)
    params = constrained("regex", "[0-9]+", grammar_replay_token_ids=letters)
    core.add_request("r", PROMPT + list(letters), params)
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    assert outputs[-1].finish_reason is FinishReason.ERROR
    assert "does not fit its grammar" in outputs[-1].error


def test_grammar_replay_needs_a_constraint():
    with pytest.raises(InvalidRequestError, match="grammar_replay_token_ids"):
        SamplingParams(grammar_replay_token_ids=(1, 2))
