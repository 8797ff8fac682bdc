"""DeepInfer's LLM keywords and defaults (spec/deepinfer.md §1.3) in deepwell's EngineArgs,
checked without loading a model."""

import pytest

from deepwell.engine.deepinfer_args import offline_engine_args, resolve_revision


def test_deepinfer_defaults_apply_where_they_mean_something():
    args = offline_engine_args(None).engine
    assert (args.max_model_len, args.max_num_seqs, args.chunked_prefill) == (4096, 256, False)
    # max(max_model_len, 4096, max_num_seqs * (1 + draft tokens)).
    assert args.max_num_batched_tokens == 4096
    wide = offline_engine_args(None, max_num_seqs=1024, num_speculative_tokens=5).engine
    assert wide.max_num_batched_tokens == 1024 * 6
    assert (
        offline_engine_args(None, max_num_batched_tokens=8192).engine.max_num_batched_tokens == 8192
    )


def test_deepwell_names_keep_their_meaning():
    args = offline_engine_args(None, memory_gib=1.5, block_size=16, chunked_prefill=True).engine
    assert (args.memory_gib, args.block_size, args.chunked_prefill) == (1.5, 16, True)


def test_tokens_per_block():
    assert offline_engine_args(None, tokens_per_block=-1).engine.block_size == 128
    assert offline_engine_args(None, tokens_per_block=64).engine.block_size == 64
    with pytest.raises(ValueError, match="one setting"):
        offline_engine_args(None, tokens_per_block=64, block_size=32)


def test_expert_parallel_size_is_deepwells_expert_parallel_data_parallel_group():
    parallel = offline_engine_args(None, expert_parallel_size=4, engine_rank=2).engine.parallel
    assert (parallel.data_parallel_size, parallel.expert_parallel, parallel.rank) == (4, True, 2)
    with pytest.raises(ValueError, match="must be equal"):
        offline_engine_args(None, expert_parallel_size=4, data_parallel_size=2)
    alone = offline_engine_args(None, data_parallel_size=2, engine_rank=1).engine.parallel
    assert (alone.data_parallel_size, alone.expert_parallel, alone.rank) == (2, False, 1)


def test_arguments_without_effect_are_noted_and_defaults_are_not():
    assert offline_engine_args(None, trust_remote_code=False, engram_parallel_size=0).notes == ()
    notes = offline_engine_args(
        None, trust_remote_code=True, engram_parallel_size=3, stop_preempted_request=True
    ).notes
    assert len(notes) == 3
    assert any("trust_remote_code=True" in n for n in notes)
    assert any("engram_parallel_size=3" in n for n in notes)


def test_unknown_keywords_and_bad_values_are_refused():
    with pytest.raises(TypeError, match="tensor_parallel_size"):
        offline_engine_args(None, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="chunked prefill"):
        offline_engine_args(None, max_model_len=8192, max_num_batched_tokens=4096)


def test_revisions_pick_a_snapshot_of_a_local_hugging_face_cache(tmp_path):
    root = tmp_path / "models--deepseek-ai--DeepSeek-V4.1-Flash-1017"
    for commit in ("aaa111", "bbb222"):
        (root / "snapshots" / commit).mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("bbb222\n")
    assert resolve_revision(str(root), None, "model") == str(root / "snapshots" / "bbb222")
    assert resolve_revision(str(root), "aaa111", "model") == str(root / "snapshots" / "aaa111")
    with pytest.raises(ValueError, match="'v2' is not in"):
        resolve_revision(str(root), "v2", "model")
    plain = tmp_path / "plain"
    plain.mkdir()
    assert resolve_revision(str(plain), None, "model") == str(plain)
    with pytest.raises(ValueError, match="Hugging Face cache"):
        resolve_revision(str(plain), "main", "tokenizer")
