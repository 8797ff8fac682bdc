"""`deepwell generate` on a DeepSeek-V4.1 checkpoint: its own chat encoding, end to end."""

import socket

import pytest

from deepwell import cli
from deepwell.engine import LLM
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint
from deepwell.recipe import Conversation, DeepseekV41Encoding, Tokenizer, UserMessage


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def test_generate_on_expert_parallel_ranks_prints_what_one_process_prints(checkpoint, capfd):
    argv = ["generate", "--raw", "--model", str(checkpoint), "Hi", "--max-tokens", "6"]
    argv += ["--threads", "1", "--memory-gib", "1", "--dtype", "float32", "--batch-invariant"]
    assert cli.main(argv) == 0
    alone = capfd.readouterr().out
    port = ["--master-port", str(free_port())]
    assert cli.main([*argv, "--data-parallel-size", "2", "--expert-parallel", *port]) == 0
    assert capfd.readouterr().out == alone


def test_generate_refuses_data_parallel_ranks_without_expert_parallelism(checkpoint, capsys):
    argv = ["generate", "--model", str(checkpoint), "Hi", "--data-parallel-size", "2"]
    assert cli.main(argv) == 2
    assert "needs --expert-parallel" in capsys.readouterr().err


def test_generate_refuses_experts_that_do_not_divide_over_the_ranks(checkpoint, capsys):
    argv = ["generate", "--model", str(checkpoint), "Hi", "--data-parallel-size", "3"]
    assert cli.main([*argv, "--expert-parallel"]) == 1
    assert "do not divide over 3 expert-parallel ranks" in capsys.readouterr().err
