"""`deepwell generate` on a DeepSeek-V4.1 checkpoint: its own chat encoding, end to end."""

import pytest

from deepwell import cli
from deepwell.engine import LLM
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint
from deepwell.recipe import Conversation, DeepseekV41Encoding, Tokenizer, UserMessage


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=2).path


def test_a_v41_model_gets_its_own_chat_encoding_without_thinking(checkpoint):
    llm = LLM(str(checkpoint), max_model_len=256, memory_gib=0.5)
    prompt, stop_ids = cli._chat_prompt(llm, "Hi there")
    encoding = DeepseekV41Encoding().with_tokenizer(Tokenizer.from_str(llm.tokenizer.to_str()))
    conversation = Conversation([UserMessage("Hi there")], thinking_mode=False)
    assert prompt == encoding.encode(conversation)
    assert llm.tokenizer.decode(prompt[-2:], skip_special_tokens=False).endswith(
        "<｜Assistant｜></think>"
    )
    assert stop_ids == []


@pytest.mark.parametrize("mode", [[], ["--raw"]])
def test_generate_answers_on_a_v41_checkpoint(checkpoint, capsys, mode):
    argv = ["generate", *mode, "--model", str(checkpoint), "Hi", "--max-tokens", "4"]
    assert cli.main([*argv, "--threads", "1", "--memory-gib", "0.5"]) == 0
    assert capsys.readouterr().out.strip()
