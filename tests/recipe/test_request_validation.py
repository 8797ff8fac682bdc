"""Malformed requests are refused with the reference's exact message, the first broken rule first.

Each case states the message deepseek_recipe 0.2.0 gives (status 400) and is also checked
against the reference itself, so the expectation cannot drift from it.
"""

from __future__ import annotations

import deepseek_recipe as dr
import pytest
from conversion_summary import convert_case

import deepwell.recipe as ours

V41 = "DeepSeek-V4.1-Flash"
QUESTION = {"role": "user", "content": "q"}
TEXT = {"type": "text", "text": "t"}
THINKING = {"type": "thinking", "thinking": "x"}
SERVER_CALL = {"type": "server_tool_use", "id": "s1", "name": "web_search", "input": {}}
SERVER_RESULT = {"type": "web_search_tool_result", "tool_use_id": "s1", "content": []}
DOCUMENT = {"type": "document", "source": {"type": "text", "media_type": "text/plain"}}
DROP = {"messages_web_search": "Drop"}
UNANSWERED = (
    "`tool_use` ids were found without `tool_result` blocks immediately after: {}. Each "
    "`tool_use` block must have a corresponding `tool_result` block in the next message."
)


def _use(call_id: str) -> dict:
    return {"type": "tool_use", "id": call_id, "name": "f", "input": {}}


def _result(call_id: str) -> dict:
    return {"type": "tool_result", "tool_use_id": call_id, "content": "r"}


def _user(*blocks: dict) -> dict:
    return {"role": "user", "content": list(blocks)}


def _assistant(*blocks: dict) -> dict:
    return {"role": "assistant", "content": list(blocks)}


def _system(*blocks: dict) -> dict:
    return {"role": "system", "content": list(blocks)}


def _messages(*messages: dict) -> dict:
    return {"model": V41, "messages": list(messages)}


def _strict_format(schema: dict) -> dict:
    return {
        "model": V41,
        "input": "q",
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}},
    }


def _refused_like_reference(dialect: str, body: dict, options: dict | None, message: str) -> None:
    theirs, _ = convert_case(dr, dialect, body, options)
    mine, _ = convert_case(ours, dialect, body, options)
    assert theirs["error"]["message"] == message
    assert theirs["error"]["status_code"] == 400
    assert mine == theirs


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "string"}, "The top level of the json schema must be an object."),
        ({"anyOf": [{"type": "object", "properties": {"a": {"type": "string"}}}]}, None),
        ({"$ref": "#/$defs/x", "$defs": {"x": {"type": "object"}}}, None),
        ({"type": ["string", "null"]}, None),
        (
            {"anyOf": [{"type": "object", "properties": {}}]},
            "An object with no properties is not allowed.",
        ),
        (
            {"type": ["object", "null"]},
            "Invalid json schema: field `type`: unknown variant `object`, expected one of "
            "`string`, `number`, `integer`, `boolean`, `null`",
        ),
    ],
)
def test_strict_response_schema_must_be_an_object_at_the_top(
    schema: dict, message: str | None
) -> None:
    message = message or "The top level of the json schema must be an object."
    _refused_like_reference("responses", _strict_format(schema), None, message)


@pytest.mark.parametrize("options", [None, DROP], ids=["reject", "drop"])
@pytest.mark.parametrize("role", [_user, _system])
@pytest.mark.parametrize(
    ("block", "name"), [(SERVER_CALL, "tool_use"), (SERVER_RESULT, "web_search_tool_result")]
)
def test_server_tool_blocks_outside_assistant_messages_are_refused(
    options: dict | None, role, block: dict, name: str
) -> None:
    body = _messages(QUESTION, role(TEXT, block))
    message = f"messages.1: `{name}` blocks can only be in `assistant` messages"
    _refused_like_reference("messages", body, options, message)


def test_server_tool_result_role_error_comes_before_unanswered_calls() -> None:
    body = _messages(QUESTION, _assistant(_use("a")), _user(SERVER_RESULT))
    message = "messages.2: `web_search_tool_result` blocks can only be in `assistant` messages"
    _refused_like_reference("messages", body, None, message)


@pytest.mark.parametrize("options", [None, DROP], ids=["reject", "drop"])
def test_repeated_tool_use_ids_in_one_message_are_refused(options: dict | None) -> None:
    body = _messages(QUESTION, _assistant(_use("a"), _use("b"), _use("a")), _user(_result("a")))
    _refused_like_reference(
        "messages", body, options, "messages.1.content.2: `tool_use` ids must be unique"
    )


def test_repeated_tool_use_id_fails_before_a_later_empty_message() -> None:
    body = _messages(_assistant(_use("a"), _use("a")), _user())
    _refused_like_reference(
        "messages", body, None, "messages.0.content.1: `tool_use` ids must be unique"
    )


def test_tool_use_ids_may_repeat_across_turns() -> None:
    body = _messages(QUESTION, _assistant(_use("a")), _user(_result("a")), _assistant(_use("a")))
    body["messages"].append(_user(_result("a")))
    theirs, _ = convert_case(dr, "messages", body)
    mine, _ = convert_case(ours, "messages", body)
    assert "error" not in theirs
    assert mine == theirs


@pytest.mark.parametrize("block", [TEXT, {"type": "text", "text": ""}, DOCUMENT])
def test_content_after_a_tool_use_in_the_same_message_is_refused(block: dict) -> None:
    body = _messages(QUESTION, _assistant(_use("b"), THINKING, _use("a"), block))
    _refused_like_reference("messages", body, None, "messages.1.3: " + UNANSWERED.format("a, b"))


def test_tool_results_after_text_are_still_paired() -> None:
    body = _messages(QUESTION, _assistant(_use("a")), _user(_result("a"), TEXT, _result("a")))
    message = (
        "messages.2.content.2: each tool_use must have a single result. Found multiple "
        "`tool_result` blocks with id: a"
    )
    _refused_like_reference("messages", body, None, message)


def test_empty_assistant_message_after_unanswered_calls_blames_the_calls() -> None:
    body = _messages(QUESTION, _assistant(_use("a")), _assistant())
    _refused_like_reference("messages", body, None, "messages.2: " + UNANSWERED.format("a"))


def test_unanswered_tool_use_ids_are_listed_in_byte_order() -> None:
    body = _messages(QUESTION, _assistant(_use("zz"), _use("c3"), _use("b")))
    _refused_like_reference("messages", body, None, "messages.1:" + UNANSWERED.format("b, c3, zz"))


def test_tool_reference_must_name_a_declared_tool() -> None:
    reference = {"type": "tool_reference", "tool_name": "zz"}
    result = {"type": "tool_result", "tool_use_id": "a", "content": [reference]}
    body = _messages(QUESTION, _assistant(_use("a")), _user(result))
    body["tools"] = [{"name": "f", "input_schema": {"type": "object"}}]
    message = "messages.2.content.0: tool reference 'zz' not found in available tools"
    _refused_like_reference("messages", body, None, message)


@pytest.mark.parametrize("kind", ["function_call", "function_call_output"])
def test_empty_call_id_is_refused_at_its_item(kind: str) -> None:
    item = {"type": kind, "call_id": "", "name": "f", "arguments": "{}", "output": "r"}
    body = {"model": V41, "input": [{"role": "user", "content": "q"}, item]}
    message = (
        "Invalid 'input[1].call_id': empty string. Expected a string with minimum length 1, "
        "but got an empty string instead."
    )
    _refused_like_reference("responses", body, None, message)


def test_strictness_must_agree_only_among_the_tools_a_named_choice_keeps() -> None:
    strict = {
        "type": "function",
        "name": "g",
        "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
        "strict": True,
    }
    body = {
        "model": V41,
        "input": "json",
        "tools": [strict, {"type": "function", "name": "h"}],
        "tool_choice": {"type": "function", "name": "g"},
        "reasoning": {"effort": "none"},
        "text": {"format": {"type": "json_object"}},
    }
    _refused_like_reference(
        "responses", body, None, "response_format should not be used with tools"
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {**_messages(QUESTION), "thinking": {"type": "enabled", "budget_tokens": -1}},
            "invalid request body: invalid value: integer `-1`, expected u64",
        ),
        (
            {**_messages(QUESTION), "tool_choice": {"type": "any", "disable_parallel_tool_use": 5}},
            "invalid request body: invalid type: integer `5`, expected a boolean",
        ),
        (
            {"model": V41, "messages": [["user", "hi", 5]]},
            "invalid request body: invalid length 3, expected fewer elements in array",
        ),
        (
            _messages({"role": "user", "content": [{"type": "image", "source": {"type": 9}}]}),
            "invalid request body: invalid value: integer `9`, expected variant index 0 <= i < 3",
        ),
    ],
)
def test_malformed_messages_fields_fail_with_serde_text(body: dict, message: str) -> None:
    theirs, _ = convert_case(dr, "messages", body)
    mine, _ = convert_case(ours, "messages", body)
    assert theirs["error"]["message"] == message
    assert mine == theirs


PNG_URL = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AA"
    "AAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"file_id": "a", "file_data": PNG_URL}, "file cannot have both file_id and file_data"),
        (
            {"file_id": "a", "filename": "a.png"},
            "file cannot have filename when file_id is present",
        ),
        ({"file": {"file_data": PNG_URL}}, "file must have a file_id or file_data"),
        (
            {"file_id": "a"},
            "file_id is not supported. Pass the image as a base64 data url instead.",
        ),
        ({"file_data": "aGk="}, "file_data is not a valid base64 data url"),
        (
            {"file_data": "data:application/pdf;base64,aGk="},
            "You have uploaded an unsupported file. Please make sure your file is valid and has "
            "one of the following formats: webp, png, jpeg, and gif.",
        ),
    ],
)
def test_chat_file_blocks_are_checked_before_images(block: dict, message: str) -> None:
    content = [{"type": "image_url", "image_url": {"url": "ftp://x"}}, {"type": "file", **block}]
    body = {"model": V41, "messages": [{"role": "user", "content": content}]}
    _refused_like_reference("chat", body, None, f".messages[0]: {message}")


def test_chat_file_with_image_data_is_an_image() -> None:
    content = [{"type": "file", "file_data": PNG_URL}]
    body = {"model": V41, "messages": [{"role": "user", "content": content}]}
    theirs, _ = convert_case(dr, "chat", body)
    mine, _ = convert_case(ours, "chat", body)
    assert theirs["converted"]["conversation"]["messages"][0]["content"] == "<｜image｜>"
    assert mine == theirs


# An `input_image` written as a JSON array is read positionally, the tag not counted, in the
# reference's field order [image_url, detail, file_id]; `detail` has a serde default, so a
# sequence may stop before it, but then fails at `file_id`, index 2.
IMAGE_TOO_SHORT = "invalid length {}, expected struct ResponsesInputImage with 3 elements"


def _image_in_output(block: list) -> dict:
    call = {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": ""}
    output = {"type": "function_call_output", "call_id": "c1", "output": [block]}
    return {"model": V41, "input": [call, output]}


def _image_in_message(block: list) -> dict:
    return {"model": V41, "input": [{"type": "message", "role": "user", "content": [block]}]}


@pytest.mark.parametrize(
    ("elements", "message"),
    [
        ([], "invalid request body: " + IMAGE_TOO_SHORT.format(0)),
        ([PNG_URL], "invalid request body: " + IMAGE_TOO_SHORT.format(2)),
        ([PNG_URL, "low"], "invalid request body: " + IMAGE_TOO_SHORT.format(2)),
        (
            [None, "https://e.com/a.png", None],
            "invalid request body: unknown variant `https://e.com/a.png`, expected one of "
            "`low`, `high`, `original`, `auto`",
        ),
        ([PNG_URL, None, "f"], "{at}: input_image cannot have both image_url and file_id"),
        (
            [None, None, "f"],
            "{at}: file_id is not supported. Pass the image as a base64 data url instead.",
        ),
        ([None, "low", None], "{at}: input_image must have image_url or file_id"),
        (
            [PNG_URL, None, None, None],
            "invalid request body: invalid length 4, expected 3 elements in sequence",
        ),
    ],
)
@pytest.mark.parametrize(
    ("body", "at"),
    [(_image_in_output, "input[1].output[0]"), (_image_in_message, "input[0].content[0]")],
    ids=["function_call_output", "message"],
)
def test_array_form_input_image_reads_image_url_detail_file_id(
    elements: list, message: str, body, at: str
) -> None:
    request = body(["input_image", *elements])
    theirs, _ = convert_case(dr, "responses", request)
    mine, _ = convert_case(ours, "responses", request)
    assert theirs["error"]["message"] == message.format(at=at)
    assert mine == theirs


@pytest.mark.parametrize("body", [_image_in_output, _image_in_message])
def test_array_form_input_image_with_detail_second_converts_like_reference(body) -> None:
    request = body(["input_image", PNG_URL, "high", None])
    theirs, _ = convert_case(dr, "responses", request)
    mine, _ = convert_case(ours, "responses", request)
    assert "error" not in theirs
    assert mine == theirs


@pytest.mark.parametrize(
    "format_elements",
    [
        ["json_schema", "x", {"type": "string"}],
        ["json_schema", "x", {"type": "object"}, None],
        ["json_schema", "x", {"type": "object"}, None, None],
        ["json_schema", "x", {"type": "object"}, True, "d"],
        ["json_schema", "x", {"type": "object"}, None, None, None],
    ],
)
def test_array_form_text_format_reads_name_schema_description_strict(format_elements) -> None:
    request = {"model": V41, "input": "json please", "text": {"format": format_elements}}
    theirs, _ = convert_case(dr, "responses", request)
    mine, _ = convert_case(ours, "responses", request)
    assert mine == theirs
