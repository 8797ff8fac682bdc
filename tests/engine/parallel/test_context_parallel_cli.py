"""`deepwell generate --context-parallel-size 2` prints what one process prints."""

import torch.distributed as dist

from deepwell import cli
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint
from deepwell.engine.parallel.context_group import ContextGroup


def test_generate_across_two_ranks_prints_the_one_rank_text(tmp_path, capsys, monkeypatch):
    announced = []
    announce = ContextGroup.announce

    def counting(group, token_ids, start):
        announced.append(start)
        announce(group, token_ids, start)

    monkeypatch.setattr(ContextGroup, "announce", counting)
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny_v41", seed=0).path
    # One byte per token: a prompt of ~90 tokens, past the 16-token threshold (2 windows).
    prompt = "the quick brown fox jumps over the lazy dog, " * 2
    argv = ["generate", "--raw", "--model", str(checkpoint), prompt, "--max-tokens", "6"]
    common = ["--threads", "1", "--memory-gib", "1", "--dtype", "float32"]
    texts = []
    for parallel in ([], ["--context-parallel-size", "2"]):
        capsys.readouterr()
        assert cli.main([*argv, *common, "--no-kv-cache-quantization", *parallel]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0].strip() and texts[0] == texts[1]
    assert announced == [0]  # the whole prompt, one chunk
    # The engine's close took the group down.
    assert not dist.is_initialized()
