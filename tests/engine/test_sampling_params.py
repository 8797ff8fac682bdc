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
