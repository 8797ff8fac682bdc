"""Bad DeepSeek-V4.1 input: clear errors at load or admission, never a crash later."""

import json

import pytest

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.errors import InvalidRequestError, ModelLoadError
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=1).path


def edit_config(path, **text_changes) -> None:
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"].update(text_changes)
    config_path.write_text(json.dumps(config))


def args(path, **kwargs) -> EngineArgs:
    return EngineArgs(model=str(path), dtype="float32", max_model_len=64, memory_gib=0.5, **kwargs)


def test_an_unknown_layer_kind_names_the_ratio(tmp_path):
    path = write_tiny_checkpoint(tmp_path, seed=1).path
    edit_config(path, compress_ratios=[0, 2, 2, 2, 4, 1, 1, 1, 0, 0, 0])
    with pytest.raises(ModelLoadError, match=r"unknown layer kinds \[4\]"):
        EngineCore(args(path))


def test_a_compressed_layer_without_a_source_of_its_ratio_is_refused(tmp_path):
    path = write_tiny_checkpoint(tmp_path, seed=1).path
    edit_config(
        path,
        compress_ratios=[0, 1, 2, 2, 1, 1, 1, 1, 0, 0, 0],
        kv_source_layer_ids=[3, 4],
        index_source_layer_ids=[3, 4, 6],
    )
    with pytest.raises(ModelLoadError, match=r"layer 1 \(ratio 1\) follows no KV source"):
        EngineCore(args(path))


@pytest.mark.parametrize("targets", [[7, 5, 6], [5, 6, 8]], ids=["unordered", "past-the-last"])
def test_dspark_target_layers_must_be_increasing_backbone_layers(tmp_path, targets):
    path = write_tiny_checkpoint(tmp_path, seed=1).path
    edit_config(path, dspark_target_layer_ids=targets)
    with pytest.raises(ModelLoadError, match="must be increasing backbone layers"):
        EngineCore(args(path, speculative_method="dspark"))
    # Without DSpark the draft stages are not built, so their targets do not matter.
    assert EngineCore(args(path, speculative_method="ngram")).speculator is not None


def test_a_missing_shard_names_the_file(tmp_path):
    written = write_tiny_checkpoint(tmp_path, seed=1)
    (written.path / written.shards[-1]).unlink()
    with pytest.raises(ModelLoadError, match=written.shards[-1]):
        EngineCore(args(written.path))


def test_a_prompt_longer_than_the_context_is_refused_and_the_engine_serves_on(checkpoint):
    core = EngineCore(args(checkpoint))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="context of 64 tokens"):
        core.add_request("long", list(range(3, 80)), params)
    core.add_request("short", list(range(3, 20)), params)
    tokens = []
    while core.has_unfinished():
        for output in core.step():
            tokens += output.new_token_ids
    assert len(tokens) == 4
