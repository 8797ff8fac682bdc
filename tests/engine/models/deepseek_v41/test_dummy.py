"""load_format "dummy" (DeepInfer's, spec/deepinfer.md §1.3): a V4.1 checkpoint's tensors drawn
from config.json alone, in the names, shapes and encodings a real load maps."""

import pytest

from deepwell.engine import LLM, SamplingParams
from deepwell.engine.errors import ModelLoadError
from deepwell.engine.models.deepseek_v41.checkpoint import load_v41_checkpoint
from deepwell.engine.models.deepseek_v41.dummy import dummy_checkpoint
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("dummy"), seed=4, draw_stored=True, keep_weights=False
    ).path


def test_dummy_tensors_have_the_stored_names_shapes_and_dtypes(tiny):
    real = load_v41_checkpoint(tiny).tensors
    dummy = dummy_checkpoint(tiny).tensors
    assert list(dummy) == list(real)
    for name, tensor in real.items():
        assert (dummy[name].shape, dummy[name].dtype) == (tensor.shape, tensor.dtype), name


def test_a_config_alone_generates_with_dummy_weights(tiny, tmp_path):
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (config_only / name).write_bytes((tiny / name).read_bytes())
    with pytest.raises(ModelLoadError):
        LLM(str(config_only), max_model_len=256)
    with LLM(
        str(config_only), load_format="dummy", max_model_len=256, decode_sequence=False
    ) as llm:
        (out,) = llm.generate(
            prompt_token_ids=[[5, 6, 7]],
            sampling_params=SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
    assert len(out.token_ids) == 3
