"""The served model's prompt encoding comes from the engine's torch-free architecture table
(engine/models/architectures.py), the one place `serve` and `deepwell generate` read it."""

import subprocess
import sys

import pytest

from deepwell.engine.models.architectures import ARCHITECTURES
from deepwell.recipe import DeepseekV4Encoding, DeepseekV41Encoding, ModelVersion
from deepwell.serve.model import deepseek_encoding


@pytest.mark.parametrize(
    ("architecture", "expected"),
    [
        ("DeepseekV41ForCausalLM", (DeepseekV41Encoding, ModelVersion.DeepseekV41Flash)),
        ("DeepseekV4ForCausalLM", (DeepseekV4Encoding, ModelVersion.DeepseekV4Pro)),
        ("LlamaForCausalLM", None),
        ("Qwen3ForCausalLM", None),
        ("MistralForCausalLM", None),
    ],
)
def test_an_architecture_names_its_encoding_or_its_chat_template(architecture, expected):
    assert deepseek_encoding(architecture) == expected


def test_every_encoding_the_table_names_resolves():
    named = [a.name for a in ARCHITECTURES.values() if a.prompt_encoding is not None]
    assert named
    assert all(deepseek_encoding(name) is not None for name in named)


def test_the_encoding_is_found_without_torch():
    code = (
        "import sys\n"
        "from deepwell.serve.model import deepseek_encoding\n"
        "assert deepseek_encoding('DeepseekV41ForCausalLM') is not None\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
