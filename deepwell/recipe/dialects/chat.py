"""OpenAI Chat Completions requests (`/v1/chat/completions`) → ConversationRequest.

Fields, message rules and error texts follow spec/recipe.md §6.1–§6.2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepwell.recipe import conversion as rules
from deepwell.recipe.conversation import (
    AssistantMessage,
    Conversation,
    LatestReminderMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolDefinition,
    ToolMessage,
    UserMessage,
)
from deepwell.recipe.conversion import ConversionOptions
from deepwell.recipe.dialects import body as b
from deepwell.recipe.dialects.body import BodyError, Struct, Tagged
from deepwell.recipe.dialects.chat_output import ChatCompletionChunkGenerator
from deepwell.recipe.dialects.images import (
    UNSUPPORTED_IMAGE_TEXT,
    BlockText,
    ImagePolicy,
    check_file_data,
    image_source,
)
from deepwell.recipe.dialects.protocol_request import ProtocolRequest
from deepwell.recipe.dialects.request_options import (
    RequestedFormat,
    RequestedSampling,
    request_options,
    response_schemas,
)
from deepwell.recipe.errors import ConversionError
from deepwell.recipe.json_value import JsonValue
from deepwell.recipe.options import ModelVersion, ThinkingInitialStage
from deepwell.recipe.request import ConversationRequest

_ORPHAN_TOOL = (
    "Messages with role 'tool' must be a response to a preceding message with 'tool_calls'"
)
_IMAGE_DETAIL = b.variants("low", "high", "original", "auto")
_BLOCK = Tagged(
    "ChatCompletionRequestContentBlock",
    "type",
    {
        "text": Struct("ChatCompletionTextBlock", {"text": b.string}, ("text",)),
        "image_url": Struct(
            "ChatCompletionImageBlock",
            {
                "image_url": Struct(
                    "ChatCompletionImageUrl",
                    {"url": b.string, "detail": b.optional(_IMAGE_DETAIL)},
                    ("url",),
                )
            },
            ("image_url",),
        ),
        # The file's fields sit on the block itself (a nested `file` object is not read).
        "file": Struct(
            "ChatCompletionFileBlock",
            dict.fromkeys(("file_id", "file_data", "filename"), b.optional(b.string)),
        ),
    },
)


@b.accepts(lambda: b.any_of(b.string, b.sequence(_BLOCK)))
def _content(value: JsonValue) -> str | list:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [_BLOCK(item) for item in value]
    raise BodyError("content should be a string or a list")


@b.accepts(lambda: b.json_schema(b.optional(_content)))
def _optional_content(value: JsonValue) -> str | list | None:
    return None if value is None else _content(value)


_FUNCTION_CALL = Struct(
    "ChatCompletionRequestFunctionCall",
    {"name": b.string, "arguments": b.string},
    ("name", "arguments"),
)
_TOOL_CALL = Struct(
    "ChatCompletionRequestToolCall",
    {"id": b.string, "type": b.variants("function"), "function": _FUNCTION_CALL},
    ("id", "type", "function"),
)
_MESSAGE = Tagged(
    "ChatCompletionRequestMessage",
    "role",
    {
        "system": Struct(
            "ChatCompletionSystemMessage",
            {"content": _content, "name": b.optional(b.string)},
            ("content",),
        ),
        "user": Struct(
            "ChatCompletionUserMessage",
            {"content": _content, "name": b.optional(b.string)},
            ("content",),
        ),
        "assistant": Struct(
            "ChatCompletionAssistantMessage",
            {
                "content": _optional_content,
                "name": b.optional(b.string),
                "reasoning_content": b.optional(b.string),
                "tool_calls": b.optional(b.sequence(_TOOL_CALL)),
                "prefix": b.optional(b.boolean),
            },
        ),
        "tool": Struct(
            "ChatCompletionToolMessage",
            {"content": _content, "tool_call_id": b.string},
            ("content", "tool_call_id"),
        ),
        "latest_reminder": Struct(
            "ChatCompletionLatestReminderMessage", {"content": b.string}, ("content",)
        ),
    },
)
_FUNCTION = Struct(
    "ChatCompletionFunctionDefinition",
    {
        "name": b.string,
        "description": b.optional(b.string),
        "parameters": b.any_value,
        "strict": b.optional(b.boolean),
    },
    ("name",),
)
_TOOL = Struct(
    "ChatCompletionTool",
    {"type": b.variants("function"), "function": _FUNCTION},
    ("type", "function"),
)
# `description` is not read (any value passes), as in the reference.
_JSON_SCHEMA = Struct(
    "ChatCompletionResponseFormatJsonSchema",
    {"schema": b.any_value, "name": b.optional(b.string), "strict": b.optional(b.boolean)},
    ("schema",),
)
_RESPONSE_FORMAT = Tagged(
    "ChatCompletionResponseFormat",
    "type",
    {
        "json_object": Struct("ChatCompletionJsonObjectFormat", {}),
        "json_schema": Struct(
            "ChatCompletionJsonSchemaFormat", {"json_schema": _JSON_SCHEMA}, ("json_schema",)
        ),
        "regex": Struct("ChatCompletionRegexFormat", {"regex": b.string}, ("regex",)),
        "text": Struct("ChatCompletionTextFormat", {}),
    },
)
_CHOICE_TYPE = b.in_field("type", b.variants("function"))
_CHOICE_FUNCTION = b.in_field(
    "function", Struct("ChatCompletionToolChoiceFunction", {"name": b.string}, ("name",))
)


@b.accepts(
    lambda: b.any_of(
        b.variants("none", "auto", "required"),
        Struct(
            "ChatCompletionNamedToolChoice",
            {"type": _CHOICE_TYPE, "function": _CHOICE_FUNCTION},
            ("type", "function"),
        ),
    )
)
def _tool_choice(value: JsonValue) -> str | tuple[str, str]:
    if value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and "type" in value:
        _CHOICE_TYPE(value["type"])
        return ("function", _CHOICE_FUNCTION(value.get("function"))["name"])
    raise BodyError("expected one of `none`, `auto`, `required` or a tool")


@b.accepts(lambda: b.any_of(b.string, b.sequence(b.string)))
def _stop(value: JsonValue) -> str | list[str]:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [b.string(item) for item in value]
    raise BodyError("expected a string or a list")


_THINKING = Struct(
    "ChatCompletionThinking",
    {
        "type": b.variants("adaptive", "enabled", "disabled"),
        "budget_tokens": b.optional(b.u64),
    },
    ("type",),
)
_STREAM_OPTIONS = Struct("ChatCompletionStreamOptions", {"include_usage": b.optional(b.boolean)})
_REQUEST = Struct(
    "ChatCompletionRequest",
    {
        "messages": b.sequence(_MESSAGE),
        "model": b.string,
        "frequency_penalty": b.optional(b.f32),
        "presence_penalty": b.optional(b.f32),
        "logprobs": b.optional(b.boolean),
        "top_logprobs": b.optional(b.u8),
        "max_tokens": b.optional(b.u32),
        "n": b.optional(b.u8),
        "stream": b.optional(b.boolean),
        "stream_options": b.optional(_STREAM_OPTIONS),
        "temperature": b.optional(b.f32),
        "top_p": b.optional(b.f32),
        "response_format": b.optional(_RESPONSE_FORMAT),
        "tools": b.optional(b.sequence(_TOOL)),
        "tool_choice": b.optional(_tool_choice),
        "parallel_tool_calls": b.optional(b.boolean),
        "thinking": b.optional(_THINKING),
        "reasoning_effort": b.optional(
            b.variants("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
        ),
        "stop": b.optional(_stop),
        "seed": b.optional(b.u64),
    },
    ("messages", "model"),
)


class ChatCompletionRequest(ProtocolRequest):
    """A Chat Completions request body; `convert` turns it into a ConversationRequest."""

    _shape = _REQUEST

    def convert(self, options: ConversionOptions) -> ConversationRequest:
        return _convert(self._take(), options)

    @staticmethod
    def chunk_generator(
        conversation_request: ConversationRequest, id: str, model: str
    ) -> ChatCompletionChunkGenerator:
        request = conversation_request
        # A streamed request without include_usage gets no `usage` key before the last chunk.
        null_usage = request.include_usage or not request.stream
        return ChatCompletionChunkGenerator(
            id,
            model,
            request.parsing_options.thinking_initial_stage,
            null_usage,
            request.conversation.thinking_mode,
        )


def _convert(f: dict[str, Any], options: ConversionOptions) -> ConversationRequest:
    version = rules.resolve_model(f["model"], options)
    _check_tool_names(f["tools"] or [])
    messages, thinking, effort = _conversation_messages(f, version, options)
    fmt, schema, regex = _response_format(f["response_format"])
    if fmt == "json_object" and not rules.mentions_json([m.content for m in messages]):
        raise ConversionError(
            "Prompt must contain the word 'json' in some form to use 'response_format' "
            "of type 'json_object'."
        )
    selection = _tool_selection(f, thinking)
    _check_prefix_request(messages, fmt, bool(f["tools"]))
    stop = _stop_sequences(f["stop"])
    if f["stream_options"] is not None and not f["stream"]:
        raise ConversionError("stream_options should be set along with stream = true")
    strict = f["response_format"][1]["json_schema"]["strict"] if fmt == "json_schema" else None
    constraint_schema, output_schema = response_schemas(fmt, schema, strict)
    # Only the tools a named tool_choice keeps must agree on strictness.
    rules.check_strict_consistency(selection.tools)
    # Any response_format, even an explicit `text`, rules out strict tools here.
    if any(tool.strict for tool in selection.tools) and f["response_format"] is not None:
        raise ConversionError("response_format should not be used with tools")
    _check_sampling(f, rules.max_tokens_bound(thinking, options))

    conversation = Conversation(
        messages,
        thinking_mode=thinking,
        tools=selection.tools,
        tool_choice=selection.tool_choice,
        reasoning_effort=effort,
        response_format="json_object" if fmt == "json_object" else "text",
        response_schema=schema,
        response_regex=regex,
    )
    sampling = RequestedSampling(
        f["max_tokens"],
        f["temperature"],
        f["top_p"],
        logprobs=bool(f["logprobs"]),
        top_logprobs=f["top_logprobs"],
        seed=f["seed"],
    )
    inference, parsing = request_options(
        version=version,
        thinking=thinking,
        selection=selection,
        sampling=sampling,
        output=RequestedFormat(fmt, constraint_schema, regex),
        stop=stop,
        options=options,
        initial_stage=_initial_stage(messages),
    )
    return ConversationRequest(
        conversation,
        version,
        inference_options=inference,
        parsing_options=parsing,
        stream=bool(f["stream"]),
        output_schema=output_schema,
        include_usage=bool((f["stream_options"] or {}).get("include_usage")),
    )


def _conversation_messages(
    f: dict[str, Any], version: ModelVersion, options: ConversionOptions
) -> tuple[list[Message], bool, str | None]:
    """The messages with the reasoning history the thinking mode keeps, the thinking mode
    and the reasoning effort."""
    raw_messages = f["messages"]
    if not raw_messages:
        raise ConversionError("Empty input messages")
    images = ImagePolicy.for_model(version, options)
    messages = _messages(raw_messages, images)
    thinking_switch = f["thinking"]
    enabled = None if thinking_switch is None else thinking_switch["type"] != "disabled"
    thinking, effort = rules.resolve_thinking(enabled, f["reasoning_effort"], options)
    rules.apply_reasoning_history(
        messages,
        thinking,
        options,
        "The `reasoning_content` in the thinking mode must be passed back to the API.",
        tools_declared=bool(f["tools"]),
    )
    _check_prefix(messages)
    return messages, thinking, effort


def _tool_selection(f: dict[str, Any], thinking: bool) -> rules.ToolSelection:
    """The tools the model may call under `tool_choice`."""
    # With tool_choice `none` the tools are dropped unchecked (names were checked before).
    tools = [] if f["tool_choice"] == "none" else _tools(f["tools"] or [])
    choice = f["tool_choice"] or "auto"
    named = choice[1] if isinstance(choice, tuple) else None
    return rules.apply_tool_choice(tools, "required" if named else choice, named, thinking)


def _check_prefix_request(messages: list[Message], fmt: str, tools_declared: bool) -> None:
    """A prefix continuation (a final assistant message with `prefix`) takes no JSON mode
    and no tools."""
    if not (messages and messages[-1].prefix):
        return
    if fmt == "json_object":
        raise ConversionError("response_format json_object should not be used with prefix")
    # Declared tools (even unused) or calls in the history rule out a prefix continuation.
    if tools_declared or any(m.tool_calls for m in messages):
        raise ConversionError("Function call should not be used with prefix")


def _stop_sequences(stop: str | list[str] | None) -> list[str]:
    if isinstance(stop, str):
        rules.check_stop([stop], single=True)
        return [stop]
    stop = stop or []
    rules.check_stop(stop)
    return stop


def _check_sampling(f: dict[str, Any], max_tokens_bound: int) -> None:
    """n, penalties, temperature, top_p, logprobs, max_tokens and seed, in the reference's order."""
    if f["n"] is not None and f["n"] != 1:
        raise ConversionError("Invalid n value (currently only n = 1 is supported)")
    rules.check_range(f["presence_penalty"], -2.0, 2.0, "presence_penalty", "[-2, 2]")
    rules.check_range(f["frequency_penalty"], -2.0, 2.0, "frequency_penalty", "[-2, 2]")
    rules.check_temperature(f["temperature"])
    rules.check_top_p(f["top_p"])
    if f["top_logprobs"] is not None:
        if not f["logprobs"]:
            raise ConversionError(
                "Invalid top_logprobs and logprobs value, logprobs must be set to true if "
                "top_logprobs is used."
            )
        if f["top_logprobs"] > 20:
            raise ConversionError(
                "Invalid top_logprobs value, the valid range of top_logprobs is [0, 20]."
            )
    rules.check_max_tokens(f["max_tokens"], max_tokens_bound)
    if f["seed"] is not None and f["seed"] >= 2**63:
        raise ConversionError("Invalid seed value, the valid range of seed is [0, 2^63)")


def _check_tool_names(declared: list[dict]) -> None:
    for index, tool in enumerate(declared):
        rules.check_tool_name(tool["function"]["name"], f"tools[{index}].function.name")


def _tools(declared: list[dict]) -> list[ToolDefinition]:
    """Tool definitions; parameter schemas checked (or normalised, when strict)."""
    tools = []
    seen: set[str] = set()
    for tool in declared:
        function = tool["function"]
        rules.claim_tool_name(function["name"], seen)
        parameters = rules.prepare_parameters(
            function["name"], function["parameters"], function["strict"]
        )
        tools.append(
            ToolDefinition(
                function["name"], function["description"], parameters, function["strict"]
            )
        )
    return tools


def _blocks(content: str | list, path: str, images: ImagePolicy, allow_images: bool) -> BlockText:
    blocks = BlockText(images)
    if isinstance(content, str):
        blocks.text(content)
        return blocks
    if images.supported:
        # Every file block is checked before any image is read.
        for kind, block in content:
            if kind == "file":
                _check_file(block, path)
    for kind, block in content:
        if kind == "text":
            blocks.text(block["text"])
        elif not images.supported:
            # V4-Pro: any non-text block is a stand-in text, never checked (spec §15.9).
            blocks.text(UNSUPPORTED_IMAGE_TEXT)
        else:
            if not allow_images:
                raise ConversionError("Image in assistant message is not supported")
            # A file is an image given as a data URL.
            url = block["image_url"] if kind == "image_url" else {"url": block["file_data"]}
            blocks.image(image_source(url["url"], url.get("detail"), path, images))
    return blocks


def _check_file(block: dict, path: str) -> None:
    """A file block names one image as `file_data` (file ids are not supported)."""
    file_id, data = block["file_id"], block["file_data"]
    if file_id is not None and data is not None:
        raise ConversionError(f"{path}: file cannot have both file_id and file_data")
    if file_id is not None and block["filename"] is not None:
        raise ConversionError(f"{path}: file cannot have filename when file_id is present")
    if data is None:
        if file_id is None:
            raise ConversionError(f"{path}: file must have a file_id or file_data")
        raise ConversionError(
            f"{path}: file_id is not supported. Pass the image as a base64 data url instead."
        )
    check_file_data(data, path)


def _message(index: int, role: str, m: dict, images: ImagePolicy) -> Message:
    path = f".messages[{index}]"
    if role == "latest_reminder":
        return LatestReminderMessage(m["content"])
    if role == "assistant":
        content = ""
        if m["content"] is not None:
            content = _blocks(m["content"], path, images, allow_images=False).content()
        calls = m["tool_calls"]
        tool_calls = None
        if calls:
            tool_calls = [
                ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls
            ]
        return AssistantMessage(content, m["reasoning_content"], tool_calls, bool(m["prefix"]))
    blocks = _blocks(m["content"], path, images, allow_images=True)
    content, sources, token = blocks.content(), blocks.sources, images.token
    if role == "system":
        return blocks.attach(SystemMessage(content, sources, image_token=token))
    if role == "user":
        return blocks.attach(UserMessage(content, sources, image_token=token))
    return blocks.attach(ToolMessage(content, m["tool_call_id"], sources, image_token=token))


@dataclass
class _PendingCalls:
    """An assistant's tool calls, and the tool messages answering them so far."""

    ids: list[str]
    answers: list[str] = field(default_factory=list)

    def answer(self, tool_call_id: str, index: int) -> None:
        """Record tool message `index` answering `tool_call_id`."""
        if tool_call_id not in self.ids:
            raise ConversionError(
                "An assistant message with 'tool_calls' must be followed by tool messages "
                "responding to each 'tool_call_id', The following tool_call_ids did not have "
                f"response messages: {tool_call_id}"
            )
        if tool_call_id in self.answers:
            raise ConversionError(
                f"Duplicate value for 'tool_call_id' of {tool_call_id} in message[{index}]"
            )
        self.answers.append(tool_call_id)

    def check_complete(self) -> None:
        if len(self.answers) < len(self.ids):
            raise ConversionError(
                "An assistant message with 'tool_calls' must be followed by tool messages "
                "responding to each 'tool_call_id'. (insufficient tool messages following "
                "tool_calls message)"
            )


def _check_assistant(index: int, fields: dict) -> None:
    if fields["content"] is None and fields["tool_calls"] is None:
        raise ConversionError("Invalid assistant message: content or tool_calls must be set")
    if fields["tool_calls"] == []:
        raise ConversionError(
            f"Invalid 'messages[{index}].tool_calls': empty array. Expected an array with "
            "minimum length 1, but got an empty array instead."
        )
    ids = [call["id"] for call in fields["tool_calls"] or []]
    for call_id in ids:
        if ids.count(call_id) > 1:
            raise ConversionError(
                f"Duplicate value for 'tool_call_id' of {call_id} in message[{index}]"
            )


def _messages(raw: list[tuple[str, dict]], images: ImagePolicy) -> list[Message]:
    """Messages in order; each assistant's calls answered by the tool messages right after.

    Each tool message must answer one of the calls (checked before its content); whether all
    calls were answered is checked when the run of tool messages ends.
    """
    messages: list[Message] = []
    pending: _PendingCalls | None = None
    for index, (role, fields) in enumerate(raw):
        if role == "tool":
            if pending is None or len(pending.answers) == len(pending.ids):
                raise ConversionError(_ORPHAN_TOOL)
            pending.answer(fields["tool_call_id"], index)
            messages.append(_message(index, role, fields, images))
            continue
        if pending is not None:
            pending.check_complete()
            pending = None
        if role == "assistant":
            _check_assistant(index, fields)
            if fields["tool_calls"]:
                pending = _PendingCalls([call["id"] for call in fields["tool_calls"]])
        message = _message(index, role, fields, images)
        # A system message with nothing in it is left out.
        if role != "system" or message.content:
            messages.append(message)
    if pending is not None:
        pending.check_complete()
    return messages


def _check_prefix(messages: list[Message]) -> None:
    for index, message in enumerate(messages):
        if message.prefix and index != len(messages) - 1:
            raise ConversionError(
                "Invalid completion message: prefix set true with message which is not final "
                "message or message role is not assistant"
            )


def _response_format(
    value: tuple[str, dict] | None,
) -> tuple[str, JsonValue, str | None]:
    if value is None:
        return "text", None, None
    kind, fields = value
    if kind == "json_schema":
        return kind, fields["json_schema"]["schema"], None
    if kind == "regex":
        return kind, None, fields["regex"]
    return kind, None, None


def _initial_stage(messages: list[Message]) -> ThinkingInitialStage:
    last = messages[-1] if messages else None
    if last is None or not last.prefix:
        return ThinkingInitialStage.ReasoningStart
    if last.content:
        return ThinkingInitialStage.ContentContinuation
    if last.reasoning_content:
        return ThinkingInitialStage.ReasoningContinuation
    return ThinkingInitialStage.ReasoningStart
