"""OpenAI Responses requests (`/v1/responses`) → ConversationRequest, namespace map and echo.

Input items, tools (functions, namespaces, apply_patch, server tools) and errors per spec §6.3, §15.
"""

from __future__ import annotations

from typing import Any

from deepwell.recipe import conversion as rules
from deepwell.recipe.conversation import (
    AssistantMessage,
    Conversation,
    ImageSource,
    Message,
    SystemMessage,
    ToolCall,
    ToolDefinition,
    ToolMessage,
    UserMessage,
)
from deepwell.recipe.conversion import ConversionOptions, WebSearchBehavior
from deepwell.recipe.dialects import body as b
from deepwell.recipe.dialects.apply_patch import (
    APPLY_PATCH_DESCRIPTION,
    APPLY_PATCH_NAME,
    APPLY_PATCH_PARAMETERS,
)
from deepwell.recipe.dialects.body import BodyError, Struct, Tagged
from deepwell.recipe.dialects.images import image_source
from deepwell.recipe.dialects.protocol_request import ProtocolRequest
from deepwell.recipe.dialects.responses_output import ResponsesChunkGenerator
from deepwell.recipe.encoding.special_tokens import SpecialToken
from deepwell.recipe.errors import ConversionError
from deepwell.recipe.json_value import JsonValue, compact_json
from deepwell.recipe.options import InferenceOptions, ModelVersion
from deepwell.recipe.request import ConversationRequest, ResponsesEcho

SERVER_TOOLS = (
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "tool_search",
    "file_search",
)
_UNSUPPORTED_DOCUMENT = "[Unsupported Document]"

_BLOCK = Tagged(
    "ResponsesInputContent",
    "type",
    {
        "input_text": Struct("ResponsesInputText", {"text": b.string}, ("text",)),
        "output_text": Struct("ResponsesOutputText", {"text": b.string}, ("text",)),
        "input_image": Struct(
            "ResponsesInputImage",
            {
                "image_url": b.optional(b.string),
                "file_id": b.optional(b.string),
                "detail": b.optional(b.variants("low", "high", "original", "auto")),
            },
        ),
        "input_file": Struct("ResponsesInputFile", {}),
    },
)


def _content(value: JsonValue) -> str | list:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [_BLOCK(item) for item in value]
    raise BodyError("content should be a string or a list of content blocks")


_OUTPUT_BLOCK = Tagged(
    "ResponsesOutputContent",
    "type",
    {k: v for k, v in _BLOCK.readers.items() if k != "output_text"},
)


def _output(value: JsonValue) -> str | list:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [_OUTPUT_BLOCK(item) for item in value]
    raise BodyError("output should be a string or a list of output content parts")


_MESSAGE = Struct(
    "ResponsesInputMessage",
    {"role": b.variants("user", "assistant", "system", "developer"), "content": _content},
    ("role", "content"),
)
_ITEMS = {
    "message": _MESSAGE,
    "function_call": Struct(
        "ResponsesFunctionCall",
        {
            "arguments": b.string,
            "call_id": b.string,
            "name": b.string,
            "namespace": b.optional(b.string),
        },
        ("arguments", "call_id", "name"),
    ),
    "function_call_output": Struct(
        "ResponsesFunctionCallOutput",
        {"call_id": b.string, "output": _output},
        ("call_id", "output"),
    ),
    "custom_tool_call": Struct(
        "ResponsesCustomToolCall",
        {"call_id": b.string, "input": b.string, "name": b.string},
        ("call_id", "input", "name"),
    ),
    "custom_tool_call_output": Struct(
        "ResponsesCustomToolCallOutput",
        {"call_id": b.string, "output": _output},
        ("call_id", "output"),
    ),
    "reasoning": Struct(
        "ResponsesReasoningItem",
        {
            "content": b.optional(
                b.sequence(
                    Tagged(
                        "ResponsesReasoningContent",
                        "type",
                        {
                            "reasoning_text": Struct(
                                "ResponsesReasoningText", {"text": b.string}, ("text",)
                            )
                        },
                    )
                )
            )
        },
    ),
}


def _item(value: JsonValue) -> tuple[str, dict] | None:
    """One input item, or None for item kinds the conversion drops."""
    if isinstance(value, dict):
        kind = value.get("type")
        if kind is None and "role" in value:
            kind = "message"
        if isinstance(kind, str):
            reader = _ITEMS.get(kind)
            return None if reader is None else (kind, reader(value))
    raise BodyError("invalid input item")


def _input(value: JsonValue) -> str | list:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [_item(item) for item in value]
    raise BodyError("input should be a string or a list of input items")


_FUNCTION_TOOL = Struct(
    "ResponsesFunctionTool",
    {
        "name": b.string,
        "description": b.optional(b.string),
        "parameters": b.any_value,
        "strict": b.optional(b.boolean),
    },
    ("name",),
)
_CUSTOM_TOOL = Struct(
    "ResponsesCustomTool",
    {"name": b.string, "description": b.optional(b.string), "format": b.any_value},
    ("name",),
)
_NAMESPACE_MEMBER = Tagged(
    "ResponsesNamespaceTool", "type", {"function": _FUNCTION_TOOL, "custom": _CUSTOM_TOOL}
)
_SERVER_TOOL = Struct("ResponsesServerTool", {})
_TOOL = Tagged(
    "ResponsesTool",
    "type",
    {
        "function": _FUNCTION_TOOL,
        "custom": _CUSTOM_TOOL,
        "namespace": Struct(
            "ResponsesNamespace",
            {
                "name": b.string,
                "description": b.optional(b.string),
                "tools": b.sequence(_NAMESPACE_MEMBER),
            },
            ("name", "tools"),
        ),
        **dict.fromkeys(SERVER_TOOLS, _SERVER_TOOL),
    },
)
_CHOICE_MESSAGE = "expected one of `none`, `auto`, `required` or a tool choice object"
_NAMED_CHOICE = Struct("ResponsesNamedToolChoice", {"name": b.string}, ("name",))


def _tool_choice(value: JsonValue) -> JsonValue:
    if value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        kind = value["type"]
        try:
            if kind in ("function", "custom"):
                _NAMED_CHOICE(value)
                return value
        except BodyError:
            pass
        if kind in ("web_search", "web_search_2025_08_26"):
            return value
    raise BodyError(_CHOICE_MESSAGE)


_FORMAT = Tagged(
    "ResponsesTextFormat",
    "type",
    {
        "text": Struct("ResponsesTextFormatText", {}),
        "json_object": Struct("ResponsesTextFormatJsonObject", {}),
        "json_schema": Struct(
            "ResponsesTextFormatJsonSchema",
            {
                "name": b.optional(b.string),
                "description": b.optional(b.string),
                "schema": b.any_value,
                "strict": b.optional(b.boolean),
            },
            ("schema",),
        ),
    },
)
_EFFORT = b.variants("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
_REQUEST = Struct(
    "ResponsesRequest",
    {
        "model": b.string,
        "input": b.optional(_input),
        "instructions": b.optional(b.string),
        "max_output_tokens": b.optional(b.u32),
        "reasoning": b.optional(
            Struct(
                "ResponsesReasoningConfig",
                {"effort": b.optional(_EFFORT), "summary": b.optional(b.string)},
            )
        ),
        "text": b.optional(
            Struct(
                "ResponsesTextConfig",
                {"format": b.optional(_FORMAT), "verbosity": b.optional(b.string)},
            )
        ),
        "tools": b.optional(b.sequence(_TOOL)),
        "tool_choice": b.optional(_tool_choice),
        "temperature": b.optional(b.f32),
        "top_p": b.optional(b.f32),
        "top_logprobs": b.optional(b.u8),
        "stream": b.optional(b.boolean),
        "user": b.optional(b.string),
    },
    ("model",),
)


class ResponsesRequest(ProtocolRequest):
    """A Responses request body; `convert` turns it into a ConversationRequest."""

    _shape = _REQUEST

    def __init__(self, body: bytes | str | dict) -> None:
        super().__init__(body)
        # The response object repeats the request's settings as given (spec §9.2).
        self._echo = _echo(self._fields)

    def namespace_tool_map(self, options: ConversionOptions) -> dict[str, tuple[str, str]]:
        """Conversation tool names that stand for `namespace` members → (namespace, name)."""
        separator = _separator(options.model_versions_by_name.get(self.model))
        out: dict[str, tuple[str, str]] = {}
        for kind, tool in self._fields["tools"] or []:
            if kind != "namespace":
                continue
            for member_kind, member in tool["tools"]:
                if member_kind == "function":
                    name = f"{tool['name']}{separator}{member['name']}"
                    out[name] = (tool["name"], member["name"])
        return out

    def echo(self) -> ResponsesEcho:
        return self._echo

    def convert(self, options: ConversionOptions) -> ConversationRequest:
        return _convert(self._take(), self._echo, options)

    @staticmethod
    def chunk_generator(
        conversation_request: ConversationRequest, id: str, model: str
    ) -> ResponsesChunkGenerator:
        return (
            ResponsesChunkGenerator(id, model)
            .with_namespace_tool_map(conversation_request.namespace_tool_map)
            .with_echo(conversation_request.echo)
        )


def _separator(version: ModelVersion | None) -> str:
    # V4-Pro spells namespaced tools `ns__member`; only V4.1-Flash uses `ns::member` (§15.1).
    return "__" if version is ModelVersion.DeepseekV4Pro else "::"


def _echo(f: dict[str, Any]) -> ResponsesEcho:
    reasoning = f["reasoning"] or {"effort": None, "summary": None}
    text = f["text"] or {"format": None, "verbosity": None}
    return ResponsesEcho(
        instructions=f["instructions"],
        max_output_tokens=f["max_output_tokens"],
        temperature=1.0 if f["temperature"] is None else f["temperature"],
        top_p=1.0 if f["top_p"] is None else f["top_p"],
        top_logprobs=f["top_logprobs"] or 0,
        user=f["user"],
        reasoning={"effort": reasoning["effort"], "summary": reasoning["summary"]},
        text={
            "format": _format_echo(text["format"]),
            "verbosity": text["verbosity"],
        },
        tool_choice="auto" if f["tool_choice"] is None else f["tool_choice"],
        tools=[_tool_echo(kind, tool) for kind, tool in f["tools"] or []],
    )


def _format_echo(value: tuple[str, dict] | None) -> JsonValue:
    if value is None:
        return {"type": "text"}
    kind, fields = value
    return {"type": kind, **{k: v for k, v in fields.items() if v is not None}}


def _function_echo(tool: dict) -> dict:
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool["description"],
        "parameters": tool["parameters"],
        "strict": tool["strict"],
    }


def _tool_echo(kind: str, tool: dict) -> JsonValue:
    if kind == "function":
        return _function_echo(tool)
    if kind == "custom":
        return {"type": "custom", **{k: v for k, v in tool.items() if v is not None}}
    if kind == "namespace":
        return {
            "type": "namespace",
            "name": tool["name"],
            "description": tool["description"],
            "tools": [_tool_echo(k, t) for k, t in tool["tools"]],
        }
    return {"type": kind}


def _convert(
    f: dict[str, Any], echo: ResponsesEcho, options: ConversionOptions
) -> ConversationRequest:
    version = rules.resolve_model(f["model"], options)
    namespace_map: dict[str, tuple[str, str]] = {}
    tools = _tools(f["tools"] or [], _separator(version), options, namespace_map)
    image_token = options.special_tokens.token(SpecialToken.Image)
    raw_input = f["input"]
    # An empty `instructions` string counts as absent.
    instructions = f["instructions"] or None
    if raw_input is None and instructions is None:
        raise ConversionError("Either input or instructions must be provided")
    if isinstance(raw_input, list) and not raw_input:
        raise ConversionError("Input items array must not be empty")
    messages: list[Message] = []
    if instructions is not None:
        messages.append(SystemMessage(instructions))
    if isinstance(raw_input, str):
        messages.append(UserMessage(raw_input))
    elif raw_input is not None:
        messages.extend(_items(raw_input, image_token, _separator(version)))

    format_kind, schema = _text_format(f["text"])
    if format_kind == "json_object" and not rules.mentions_json([m.content for m in messages]):
        raise ConversionError(
            "Response input messages must contain the word 'json' in some form to use "
            "'text.format' of type 'json_object'."
        )
    effort = (f["reasoning"] or {}).get("effort")
    thinking, conversation_effort = rules.resolve_thinking(None, effort, options)
    choice, named = _choice(f["tool_choice"])
    selection = rules.apply_tool_choice(tools, choice, named, thinking)
    if any(tool.strict for tool in selection.tools) and format_kind != "text":
        raise ConversionError("response_format should not be used with tools")
    rules.check_temperature(f["temperature"])
    rules.check_top_p(f["top_p"])
    rules.check_max_tokens(f["max_output_tokens"], rules.max_tokens_bound(thinking, options))
    rules.apply_reasoning_history(
        messages,
        thinking,
        options,
        "The `reasoning_text` in the thinking mode must be passed back to the API.",
    )
    constraint_schema = schema
    if format_kind == "json_schema":
        constraint_schema = schema = rules.normalize_response_schema(schema)
    conversation = Conversation(
        messages,
        thinking_mode=thinking,
        tools=selection.tools,
        tool_choice=selection.tool_choice,
        reasoning_effort=conversation_effort,
        response_format="json_object" if format_kind == "json_object" else "text",
        response_schema=schema,
    )
    tools_active = bool(selection.tools) and selection.tool_choice != "none"
    top_logprobs = f["top_logprobs"]
    inference = InferenceOptions(
        max_tokens=f["max_output_tokens"],
        temperature=rules.resolve_temperature(f["temperature"], thinking),
        top_p=rules.resolve_top_p(f["top_p"], thinking, version),
        logprobs=top_logprobs is not None,
        top_logprobs=top_logprobs,
        output_constraint=rules.output_constraint(
            selection.tools, selection.tool_choice, format_kind, constraint_schema, None
        ),
    )
    parsing = rules.parsing_options(
        tools_active=tools_active,
        tool_choice=selection.tool_choice,
        response_format=format_kind,
        thinking=thinking,
        stop=[],
        special_tokens=options.special_tokens,
    )
    return ConversationRequest(
        conversation,
        version,
        inference_options=inference,
        parsing_options=parsing,
        stream=bool(f["stream"]),
        namespace_tool_map=namespace_map,
        echo=echo,
    )


def _tools(
    declared: list[tuple[str, dict]],
    separator: str,
    options: ConversionOptions,
    namespace_map: dict[str, tuple[str, str]],
) -> list[ToolDefinition]:
    """Conversation tools; records each namespace member's name in `namespace_map`."""
    tools: list[ToolDefinition] = []
    for index, (kind, tool) in enumerate(declared):
        if kind == "function":
            rules.check_tool_name(tool["name"], f"tools[{index}].name")
            tools.append(_function(tool["name"], tool["description"], tool))
        elif kind == "custom":
            if tool["name"] != APPLY_PATCH_NAME:
                raise ConversionError(
                    f"Unsupported custom tool: '{tool['name']}'. Only 'apply_patch' is supported."
                )
            tools.append(
                ToolDefinition(APPLY_PATCH_NAME, APPLY_PATCH_DESCRIPTION, APPLY_PATCH_PARAMETERS)
            )
        elif kind == "namespace":
            tools.extend(_namespace(index, tool, separator, namespace_map))
        elif options.responses_web_search is WebSearchBehavior.Reject:
            raise ConversionError("Server tools are not supported")
    rules.check_unique_names([tool.name for tool in tools])
    rules.check_strict_consistency(tools)
    return tools


def _function(name: str, description: str | None, tool: dict) -> ToolDefinition:
    parameters = rules.prepare_parameters(tool["name"], tool["parameters"], tool["strict"])
    return ToolDefinition(name, description, parameters, tool["strict"])


def _namespace(
    index: int, namespace: dict, separator: str, namespace_map: dict[str, tuple[str, str]]
) -> list[ToolDefinition]:
    members = []
    for position, (kind, member) in enumerate(namespace["tools"]):
        if kind == "custom":
            raise ConversionError(
                "Currently custom tools are not allowed inside a namespace. Found custom tool "
                f"'{member['name']}' in tools[{index}].tools[{position}]."
            )
        rules.check_tool_name(member["name"], f"tools[{index}].tools[{position}].name")
        members.append(member)
    rules.check_unique_names(
        [m["name"] for m in members], "Tool names within a namespace must be unique."
    )
    out = []
    for member in members:
        description = f"{namespace['description'] or ''}\n{member['description'] or ''}"
        tool = _function(f"{namespace['name']}{separator}{member['name']}", description, member)
        namespace_map[tool.name] = (namespace["name"], member["name"])
        out.append(tool)
    return out


def _choice(value: JsonValue) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        return value, None
    if value["type"] in ("function", "custom"):
        return "required", value["name"]
    return "auto", None


def _text_format(text: dict | None) -> tuple[str, JsonValue]:
    if text is None or text["format"] is None:
        return "text", None
    kind, fields = text["format"]
    return kind, fields.get("schema")


def _blocks(
    content: str | list, path: str, part: str, image_token: str, *, assistant: bool = False
) -> tuple[str, list[ImageSource]]:
    """Text of a content list (blocks joined by blank lines) and its images.

    `part` names the list in error paths (`content` or `output`).
    """
    if isinstance(content, str):
        return content, []
    parts: list[str] = []
    images: list[ImageSource] = []
    for position, (kind, block) in enumerate(content):
        if kind in ("input_text", "output_text"):
            parts.append(block["text"])
        elif kind == "input_file":
            parts.append(_UNSUPPORTED_DOCUMENT)
        else:
            where = f"{path}.{part}[{position}]"
            url, file_id = block["image_url"], block["file_id"]
            if url is None and file_id is None:
                raise ConversionError(f"{where}: input_image must have image_url or file_id")
            if url is not None and file_id is not None:
                raise ConversionError(
                    f"{where}: input_image cannot have both image_url and file_id"
                )
            if file_id is not None:
                raise ConversionError(
                    f"{where}: file_id is not supported. Pass the image as a base64 data url "
                    "instead."
                )
            if assistant:
                raise ConversionError(f"{path}: Image in assistant message is unsupported")
            images.append(image_source(url, block["detail"], path))
            parts.append(image_token)
    return "\n\n".join(parts), images


class _Turn:
    """One assistant turn being folded from adjacent items, and the tool outputs after it."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.reasoning: list[str] | None = None
        self.calls: list[ToolCall] = []
        self.outputs: list[ToolMessage] = []

    def message(self) -> AssistantMessage:
        reasoning = None if self.reasoning is None else "\n".join(self.reasoning)
        return AssistantMessage("\n\n".join(self.texts), reasoning, self.calls or None)


def _items(items: list, image_token: str, separator: str) -> list[Message]:
    """Fold the item list into messages: adjacent reasoning, text and calls form one turn."""
    messages: list[Message] = []
    turn: _Turn | None = None
    seen_calls: set[str] = set()

    def close() -> None:
        nonlocal turn
        if turn is None:
            return
        answered = {output.tool_call_id for output in turn.outputs}
        for call in turn.calls:
            if call.id not in answered:
                raise ConversionError(f"No tool output found for tool call {call.id}.")
        order = [call.id for call in turn.calls]
        messages.append(turn.message())
        messages.extend(sorted(turn.outputs, key=lambda m: order.index(m.tool_call_id)))
        turn = None

    def current(*, fresh_if: bool) -> _Turn:
        nonlocal turn
        if turn is not None and (turn.outputs or fresh_if):
            close()
        if turn is None:
            turn = _Turn()
        return turn

    for index, entry in enumerate(items):
        if entry is None:
            continue
        kind, item = entry
        path = f"input[{index}]"
        if kind == "message":
            role = item["role"]
            is_assistant = role == "assistant"
            content, images = _blocks(
                item["content"], path, "content", image_token, assistant=is_assistant
            )
            if is_assistant:
                current(fresh_if=bool(turn and turn.calls)).texts.append(content)
                continue
            close()
            if role == "user":
                messages.append(UserMessage(content, images, image_token=image_token))
            else:
                messages.append(SystemMessage(content, images, image_token=image_token))
        elif kind == "reasoning":
            folded = current(fresh_if=bool(turn and (turn.texts or turn.calls)))
            texts = [part["text"] for _, part in item["content"] or []]
            folded.reasoning = (folded.reasoning or []) + texts
        elif kind in ("function_call", "custom_tool_call"):
            if item["call_id"] in seen_calls:
                raise ConversionError(f"Duplicate 'call_id': {item['call_id']}.")
            seen_calls.add(item["call_id"])
            if kind == "function_call":
                name = item["name"]
                if item["namespace"] is not None:
                    name = f"{item['namespace']}{separator}{name}"
                arguments = item["arguments"]
            else:
                name = item["name"]
                arguments = compact_json({"input": item["input"]})
            current(fresh_if=False).calls.append(ToolCall(item["call_id"], name, arguments))
        else:
            call_id = item["call_id"]
            if turn is not None and any(o.tool_call_id == call_id for o in turn.outputs):
                raise ConversionError(f"Duplicate tool output for call_id: {call_id}.")
            if turn is None or all(call.id != call_id for call in turn.calls):
                raise ConversionError(
                    f"No tool call found for tool output with call_id {call_id}."
                )
            content, images = _blocks(item["output"], path, "output", image_token)
            turn.outputs.append(ToolMessage(content, call_id, images, image_token=image_token))
    close()
    return messages
