"""`deepwell render` and `deepwell tokenize`: requests in, prompts and ids out, errors exit 2.

Runs the real CLI entry point in-process on the example request and small bodies.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from vector_cases import TOKENIZER_PATH

from deepwell import cli
from deepwell.recipe import (
    Conversation,
    DeepseekV4Encoding,
    DeepseekV41Encoding,
    SystemMessage,
    UserMessage,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "chat_request.json"
V4_CHAT = {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "Hi <think>"}]}


def _run(
    argv: list[str], capsys, stdin: str | None = None, monkeypatch=None
) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_example_request_renders_with_the_v41_encoding(capsys) -> None:
    code, out, _ = _run(["render", str(EXAMPLE)], capsys)
    body = json.loads(EXAMPLE.read_text(encoding="utf-8"))
    expected = DeepseekV41Encoding().render_conversation(
        Conversation(
            [
                SystemMessage(body["messages"][0]["content"]),
                UserMessage(body["messages"][1]["content"]),
            ],
            reasoning_effort="high",
        )
    )
    assert code == 0
    assert out == expected.prompt


def test_stdin_request_of_a_v4_model_renders_with_v4(capsys, monkeypatch) -> None:
    code, out, _ = _run(["render", "-"], capsys, json.dumps(V4_CHAT), monkeypatch)
    assert code == 0
    assert out.startswith("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum")
    assert out.endswith("<｜User｜>Hi <think><｜Assistant｜><think>")


def test_v41_flag_overrides_the_model_encoding(capsys, monkeypatch) -> None:
    code, out, _ = _run(["render", "--v41"], capsys, json.dumps(V4_CHAT), monkeypatch)
    assert code == 0
    assert out.startswith("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75")


def test_ids_match_the_encoding(capsys, monkeypatch) -> None:
    code, out, _ = _run(
        ["render", "--ids", "--tokenizer", str(TOKENIZER_PATH)],
        capsys,
        json.dumps(V4_CHAT),
        monkeypatch,
    )
    assert code == 0
    ids = json.loads(out)
    assert ids[0] == 0 and ids[-2:] == [128804, 128821]
    # The user-typed <think> is plain text: three ordinary ids, not 128821.
    assert ids.count(128821) == 1


def test_ids_without_tokenizer_is_a_usage_error(capsys, monkeypatch) -> None:
    code, _, err = _run(["render", "--ids"], capsys, json.dumps(V4_CHAT), monkeypatch)
    assert code == 2
    assert "--tokenizer" in err


def test_missing_control_token_in_tokenizer_exits_1(capsys) -> None:
    code, _, err = _run(
        ["render", str(EXAMPLE), "--ids", "--tokenizer", str(TOKENIZER_PATH)], capsys
    )
    assert code == 1
    assert 'special token "<｜System｜>" is not in the added vocabulary' in err


def test_conversion_error_prints_the_dialect_body_and_exits_2(capsys, monkeypatch) -> None:
    body = {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    code, out, err = _run(["render"], capsys, json.dumps(body), monkeypatch)
    assert code == 2 and out == ""
    error = json.loads(err)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("The supported API model names are")


def test_invalid_json_exits_2_with_an_error_body(capsys, monkeypatch) -> None:
    code, _, err = _run(["render"], capsys, "nope", monkeypatch)
    assert code == 2
    assert (
        json.loads(err)["error"]["message"]
        == "invalid JSON request: expected ident at line 1 column 2"
    )


def test_messages_dialect_errors_come_in_anthropic_shape(capsys, monkeypatch) -> None:
    body = {
        "model": "nope",
        "max_tokens": 5,
        "system": "s",
        "messages": [{"role": "user", "content": "x"}],
    }
    code, _, err = _run(["render"], capsys, json.dumps(body), monkeypatch)
    assert code == 2
    assert json.loads(err)["type"] == "error"


@pytest.mark.parametrize(
    ("body", "dialect"),
    [
        ({"model": "m", "input": "x"}, "responses"),
        ({"model": "m", "max_tokens": 1, "system": "s", "messages": []}, "messages"),
        (
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a"}]}
                ],
            },
            "messages",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "chat"),
        ([1, 2], "chat"),
    ],
)
def test_dialect_is_detected_from_the_body_shape(body: object, dialect: str) -> None:
    assert cli.detect_dialect(body) == dialect


def test_terminal_output_highlights_control_tokens() -> None:
    rendered = DeepseekV4Encoding().render_conversation(
        Conversation([UserMessage("<｜User｜>")], thinking_mode=False)
    )

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    cli._write_prompt(stream, rendered.prompt, rendered.special_ranges)
    text = stream.getvalue()
    # The user-typed spelling is plain text, the real turn marker is coloured.
    assert text.count("\x1b[1;36m<｜User｜>\x1b[0m") == 1
    assert text.count("<｜User｜>") == 2
    assert text.endswith("\n")


def test_tokenize_full_plain_and_decode(capsys) -> None:
    text = "hi <｜User｜> <think>"
    assert (
        _run(["tokenize", "--tokenizer", str(TOKENIZER_PATH), text], capsys)[1]
        == "[6366, 223, 128803, 223, 128821]\n"
    )
    plain = json.loads(
        _run(["tokenize", "--tokenizer", str(TOKENIZER_PATH), "--plain", text], capsys)[1]
    )
    assert 128803 not in plain and 128821 not in plain
    decoded = _run(
        ["tokenize", "--tokenizer", str(TOKENIZER_PATH), "--decode", json.dumps(plain)], capsys
    )[1]
    assert decoded == text


def test_help_lists_every_subcommand(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for command in cli.COMMANDS:
        assert command.name in out


def test_unreadable_file_exits_2(capsys, tmp_path) -> None:
    code, _, err = _run(["render", str(tmp_path / "missing.json")], capsys)
    assert code == 2
    assert "missing.json" in err
