"""SamplingParams is torch-free (it travels through the HTTP process) and names the field a
refused value came in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]

# The request path's types the HTTP process builds, sends or reads.
REQUEST_PATH = (
    "deepwell.engine.sampling_params",
    "deepwell.engine.stats",
    "deepwell.engine.kv.prefix_hash",
    "deepwell.serve.messages",
    "deepwell.serve.sampling_fields",
)


def test_the_request_path_types_import_without_torch() -> None:
    script = "import sys\n" + "".join(f"import {m}\n" for m in REQUEST_PATH)
    script += "print('torch' in sys.modules)\n"
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"logit_bias": {5: 101.0}}, "logit_bias[5]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"top_logprobs": 1001}, "top_logprobs"),
    ],
)
def test_a_refused_value_names_its_field(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**fields)
    assert error.value.param == param
    assert param.split("[")[0] in str(error.value)


def test_deepinfer_rules_for_max_tokens_temperature_and_top_logprobs():
    assert SamplingParams(max_tokens=0).max_tokens == 1
    clamped = SamplingParams(temperature=1e-7, top_p=0.5, top_k=3)
    assert (clamped.temperature, clamped.top_p, clamped.top_k) == (1e-5, 1.0, -1)
    assert SamplingParams(temperature=0).greedy
    wide = SamplingParams(top_logprobs=1000)
    assert wide.logprobs and wide.top_logprobs == 1000


def test_seq_seed_and_seed_are_one_setting():
    assert SamplingParams(seq_seed=-1).seed == 2**64 - 1
    assert SamplingParams(seed=7).seq_seed == 7
    assert SamplingParams(seed=7, seq_seed=7).seed == 7
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(seed=7, seq_seed=8)
    assert error.value.param == "seq_seed"


def test_so_args_become_a_structured_output():
    regex = SamplingParams(so_args={"schema_type": "regex", "schema": "[0-9]+"})
    assert regex.so_args is None
    assert (regex.structured_output.kind, regex.structured_output.spec) == ("regex", "[0-9]+")
    schema = {"type": "object"}
    json_so = SamplingParams(
        so_args={
            "schema_type": "json",
            "schema": schema,
            "trigger_token_ids": [3, 4],
            "bound_token_id": 5,
        }
    ).structured_output
    assert json_so.kind == "json_schema" and json_so.trigger_token_ids == (3, 4)
    assert json_so.bound_token_id == 5
    ebnf = SamplingParams(
        so_args={"schema_type": "ebnf", "schema": 'root ::= item+\nitem ::= [a-z] | "-"'}
    ).structured_output
    # Translated to the Lark grammar the matcher compiles.
    assert ebnf.kind == "ebnf" and ebnf.spec.startswith("%llguidance")
    assert "start:" in ebnf.spec


@pytest.mark.parametrize(
    ("so_args", "named"),
    [
        ({"schema_type": "ebnf", "schema": 'root ::= "a" (= "b")'}, "lookahead"),
        ({"schema_type": "ebnf", "schema": "root ::= TagDispatch(x)"}, "TagDispatch"),
        ({"schema_type": "ebnf", "schema": "root ::= missing"}, "does not parse"),
        ({"schema_type": "xml", "schema": "x"}, "schema_type"),
        ({"schema_type": "json", "schema": "{}", "serialized": "..."}, "serialized"),
        ({"schema_type": "json", "schema": "{}", "bound_token_ids": [1]}, "bound_token_ids"),
        ({"schema_type": "regex", "schema": "a", "bound_token_id": 3}, "bound_token_id"),
    ],
)
def test_bad_so_args_are_refused_naming_what_is_wrong(so_args, named):
    with pytest.raises(InvalidRequestError, match=named) as error:
        SamplingParams(so_args=so_args)
    assert error.value.param == "so_args"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt_logprobs": 1001}, "prompt_logprobs"),
        ({"prompt_logprobs": "yes"}, "prompt_logprobs"),
        ({"first_n_token_no_eos": -1}, "first_n_token_no_eos"),
        ({"eos_id": -2}, "eos_id"),
        ({"golden_token_ids": [1, -1]}, "golden_token_ids"),
    ],
)
def test_bad_deepinfer_fields_name_themselves(fields, param):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**fields)
    assert error.value.param == param


def test_prompt_logprobs_true_takes_top_logprobs_and_an_int_its_own_count():
    assert SamplingParams(prompt_logprobs=True, top_logprobs=3).prompt_top_logprobs == 3
    assert SamplingParams(prompt_logprobs=0).wants_prompt_logprobs
    assert not SamplingParams(prompt_logprobs=False).wants_prompt_logprobs
    assert SamplingParams(prompt_logprobs=5).prompt_top_logprobs == 5
