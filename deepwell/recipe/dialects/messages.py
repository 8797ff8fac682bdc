"""Anthropic Messages requests (`/v1/messages`) → ConversationRequest.

Blocks, tool_use/tool_result pairing, deferred tools and errors per spec §6.4.
"""

from __future__ import annotations

from typing import Any

from deepwell.recipe import conversion as rules
from deepwell.recipe.conversation import (
    AssistantMessage,
    Conversation,
    DataUrlImageSource,
    Message,
    SystemMessage,
    ToolCall,
    ToolDefinition,
    ToolMessage,
    UserMessage,
)
from deepwell.recipe.conversion import ConversionOptions, WebSearchBehavior
from deepwell.recipe.dialects import body as b
from deepwell.recipe.dialects.body import BodyError, Struct, Tagged
from deepwell.recipe.dialects.images import image_source
from deepwell.recipe.dialects.messages_output import MessagesChunkGenerator
from deepwell.recipe.dialects.protocol_request import ProtocolRequest
from deepwell.recipe.encoding.special_tokens import SpecialToken
from deepwell.recipe.errors import ConversionError
from deepwell.recipe.json_value import JsonValue, py_json
from deepwell.recipe.options import InferenceOptions
from deepwell.recipe.request import ConversationRequest
from deepwell.recipe.schema import check_parameters_schema

_SERVER_BLOCKS = ("server_tool_use", "web_search_tool_result")
_IMAGE_SOURCE = Tagged(
    "MessagesImageSource",
    "type",
    {
        "base64": Struct(
            "MessagesBase64Source",
            {
                "media_type": b.variants(
                    "image/jpeg", "image/jpg", "image/png", "image/gif", "image/webp", "data"
                ),
                "data": b.string,
            },
            ("media_type", "data"),
        ),
        "url": Struct("MessagesUrlSource", {"url": b.string}, ("url",)),
    },
)
_TOOL_REFERENCE = Struct(
    "MessagesToolReference",
    {"type": b.variants("tool_reference"), "name": b.string},
    ("type", "name"),
)
_TEXT = Struct("MessagesTextBlock", {"text": b.string}, ("text",))
_RESULT_BLOCK = Tagged(
    "MessagesToolResultContent",
    "type",
    {
        "text": _TEXT,
        "image": Struct("MessagesImageBlock", {"source": _IMAGE_SOURCE}, ("source",)),
        "tool_reference": Struct("MessagesToolReferenceBlock", {"name": b.string}, ("name",)),
    },
)


def _result_content(value: JsonValue) -> str | list:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [_RESULT_BLOCK(item) for item in value]
    raise BodyError("expected a string or a list")


_BLOCK = Tagged(
    "MessagesContentBlock",
    "type",
    {
        "text": _TEXT,
        "image": Struct("MessagesImageBlock", {"source": _IMAGE_SOURCE}, ("source",)),
        "document": Struct("MessagesDocumentBlock", {"source": b.any_value}),
        "thinking": Struct(
            "MessagesThinkingBlock",
            {"thinking": b.string, "signature": b.optional(b.string)},
            ("thinking",),
        ),
        "tool_use": Struct(
            "MessagesToolUseBlock",
            {"id": b.string, "name": b.string, "input": b.any_value},
            ("id", "name", "input"),
        ),
        "tool_result": Struct(
            "MessagesToolResultBlock",
            {
                "tool_use_id": b.string,
                "content": b.optional(_result_content),
                "is_error": b.optional(b.boolean),
            },
            ("tool_use_id",),
        ),
        "server_tool_use": Struct("MessagesServerToolUse", {}),
        "web_search_tool_result": Struct("MessagesWebSearchToolResult", {}),
        "tool_addition": Struct("MessagesToolAddition", {"tool": _TOOL_REFERENCE}, ("tool",)),
    },
)


def _content(value: JsonValue) -> str | list:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [_BLOCK(item) for item in value]
    raise BodyError("expected a string or a list")


def _message(value: JsonValue) -> tuple[str, str | list]:
    if not isinstance(value, dict):
        raise b.invalid_type(value, "adjacently tagged enum MessagesMessage")
    if "role" not in value:
        raise BodyError("missing field `role`")
    role = b.variants("user", "assistant", "system")(value["role"])
    if "content" not in value:
        raise BodyError("missing field `content`")
    return role, _content(value["content"])


def _system(value: JsonValue) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        block = Tagged("MessagesSystemBlock", "type", {"text": _TEXT})
        return "\n\n".join(block(item)[1]["text"] for item in value)
    raise BodyError("expected a string or a list")


_TOOL_FIELDS = Struct(
    "MessagesTool",
    {
        "name": b.string,
        "description": b.optional(b.string),
        "input_schema": b.any_value,
        "strict": b.optional(b.boolean),
        "defer_loading": b.optional(b.boolean),
    },
    ("name",),
)


def _tool(value: JsonValue) -> dict:
    if not isinstance(value, dict):
        raise BodyError("missing field `name`")
    tool = _TOOL_FIELDS(value)
    kind = value.get("type")
    tool["type"] = kind if isinstance(kind, str) else None
    return tool


_TOOL_CHOICE = Tagged(
    "MessagesToolChoice",
    "type",
    {
        "auto": Struct("MessagesToolChoiceAuto", {}),
        "any": Struct("MessagesToolChoiceAny", {}),
        "tool": Struct("MessagesToolChoiceTool", {"name": b.string}, ("name",)),
        "none": Struct("MessagesToolChoiceNone", {}),
    },
)
_REQUEST = Struct(
    "MessagesRequest",
    {
        "model": b.string,
        "messages": b.sequence(_message),
        "max_tokens": b.optional(b.u32),
        "system": b.optional(_system),
        "thinking": b.optional(
            Struct(
                "MessagesThinking",
                {
                    "type": b.variants("enabled", "disabled", "adaptive"),
                    "budget_tokens": b.optional(b.u32),
                },
                ("type",),
            )
        ),
        "output_config": b.optional(
            Struct(
                "MessagesOutputConfig",
                {
                    "effort": b.optional(
                        b.variants(
                            "none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"
                        )
                    )
                },
            )
        ),
        "temperature": b.optional(b.f32),
        "top_p": b.optional(b.f32),
        "stop_sequences": b.optional(b.sequence(b.string)),
        "stream": b.optional(b.boolean),
        "tools": b.optional(b.sequence(_tool)),
        "tool_choice": b.optional(_TOOL_CHOICE),
        "metadata": b.optional(Struct("MessagesMetadata", {"user_id": b.optional(b.string)})),
    },
    ("model", "messages"),
)


class MessagesRequest(ProtocolRequest):
    """An Anthropic Messages request body; `convert` turns it into a ConversationRequest."""

    _shape = _REQUEST

    def convert(self, options: ConversionOptions) -> ConversationRequest:
        return _convert(self._take(), options)

    @staticmethod
    def chunk_generator(
        conversation_request: ConversationRequest, id: str, model: str
    ) -> MessagesChunkGenerator:
        return MessagesChunkGenerator(id, model, conversation_request.conversation.thinking_mode)


def _convert(f: dict[str, Any], options: ConversionOptions) -> ConversationRequest:
    version = rules.resolve_model(f["model"], options)
    tools = _tools(f["tools"] or [], options)
    if not f["messages"]:
        raise ConversionError("messages: at least one message is required")
    image_token = options.special_tokens.token(SpecialToken.Image)
    messages: list[Message] = []
    if f["system"] is not None:
        messages.append(SystemMessage(f["system"]))
    _check_pairing(f["messages"])
    for index, (role, content) in enumerate(f["messages"]):
        messages.extend(_convert_message(index, role, content, tools, image_token, options))

    switch = f["thinking"]
    enabled = None if switch is None else switch["type"] != "disabled"
    effort = (f["output_config"] or {}).get("effort")
    thinking, conversation_effort = rules.resolve_thinking(enabled, effort, options)
    choice = f["tool_choice"]
    kind = "auto" if choice is None else choice[0]
    named = choice[1]["name"] if kind == "tool" else None
    selection = rules.apply_tool_choice(
        tools, {"any": "auto", "tool": "required"}.get(kind, kind), named, thinking
    )
    rules.check_temperature(f["temperature"])
    rules.check_top_p(f["top_p"])
    bound = rules.max_tokens_bound(thinking, options)
    max_tokens = f["max_tokens"]
    if max_tokens is not None:
        # Messages clamps an over-large max_tokens instead of refusing it (spec §6.1).
        rules.check_max_tokens(max_tokens, max(bound, max_tokens))
        max_tokens = min(max_tokens, bound)
    rules.apply_reasoning_history(
        messages,
        thinking,
        options,
        "The `content[].thinking` in the thinking mode must be passed back to the API.",
    )
    conversation = Conversation(
        messages,
        thinking_mode=thinking,
        tools=selection.tools,
        tool_choice=selection.tool_choice,
        reasoning_effort=conversation_effort,
    )
    tools_active = bool(selection.tools) and selection.tool_choice != "none"
    stop = f["stop_sequences"] or []
    inference = InferenceOptions(
        max_tokens=max_tokens,
        temperature=rules.resolve_temperature(f["temperature"], thinking),
        top_p=rules.resolve_top_p(f["top_p"], thinking, version),
        output_constraint=rules.output_constraint(
            selection.tools, selection.tool_choice, "text", None, None
        ),
    )
    parsing = rules.parsing_options(
        tools_active=tools_active,
        tool_choice=selection.tool_choice,
        response_format="text",
        thinking=thinking,
        stop=stop,
        special_tokens=options.special_tokens,
    )
    return ConversationRequest(
        conversation,
        version,
        inference_options=inference,
        parsing_options=parsing,
        stream=bool(f["stream"]),
    )


def _tools(declared: list[dict], options: ConversionOptions) -> list[ToolDefinition]:
    tools: list[ToolDefinition] = []
    for index, tool in enumerate(declared):
        kind = tool["type"]
        if kind is not None:
            if (
                kind.startswith("web_search")
                and options.messages_web_search is WebSearchBehavior.Drop
            ):
                continue
            raise ConversionError(f"tools[{index}]: server tools are not supported")
        rules.check_tool_name(tool["name"], f"tools[{index}].name")
    for tool in declared:
        if tool["type"] is not None:
            continue
        check_parameters_schema(tool["name"], tool["input_schema"])
        tools.append(
            ToolDefinition(
                tool["name"],
                tool["description"],
                tool["input_schema"],
                None,
                bool(tool["defer_loading"]),
            )
        )
    rules.check_unique_names([tool.name for tool in tools])
    if tools and all(tool.defer_loading for tool in tools):
        raise ConversionError(
            "tools: at least one tool must have defer_loading=false. All tools cannot be deferred."
        )
    return tools


def _check_pairing(messages: list[tuple[str, str | list]]) -> None:
    """Each assistant tool_use answered by a tool_result in the very next message."""
    for index, (role, content) in enumerate(messages):
        if role != "assistant" or isinstance(content, str):
            continue
        ids = [block["id"] for kind, block in content if kind == "tool_use"]
        if not ids:
            continue
        following = messages[index + 1] if index + 1 < len(messages) else None
        answered: list[str] = []
        if following is not None and not isinstance(following[1], str):
            answered = [
                block["tool_use_id"] for kind, block in following[1] if kind == "tool_result"
            ]
        missing = [i for i in ids if i not in answered]
        if missing:
            where = f"messages.{index + 1}: " if following is not None else f"messages.{index}:"
            raise ConversionError(
                f"{where}`tool_use` ids were found without `tool_result` blocks immediately "
                f"after: {', '.join(missing)}. Each `tool_use` block must have a "
                "corresponding `tool_result` block in the next message."
            )


def _convert_message(
    index: int,
    role: str,
    content: str | list,
    tools: list[ToolDefinition],
    image_token: str,
    options: ConversionOptions,
) -> list[Message]:
    if isinstance(content, str):
        if role == "assistant":
            return [AssistantMessage(content)]
        if role == "system":
            return [SystemMessage(content)]
        return [UserMessage(content)]
    if not content:
        raise ConversionError(f"messages.{index}: all messages must have non-empty content")
    if role == "assistant":
        return [_assistant(index, content, options)]
    out: list[Message] = []
    results: list[Message] = []
    trailing: list[Message] = []
    for position, (kind, block) in enumerate(content):
        path = f"messages.{index}.content[{position}]"
        if kind == "text":
            out.append(
                SystemMessage(block["text"]) if role == "system" else UserMessage(block["text"])
            )
        elif kind == "image":
            out.append(_image(block["source"], path, image_token))
        elif kind == "document":
            out.append(UserMessage("[Unsupported document type: text/plain]"))
        elif kind == "thinking":
            raise ConversionError(
                f"messages.{index}.content: thinking blocks may only be in `assistant` messages"
            )
        elif kind == "tool_result":
            tool_message, announced = _tool_result(index, position, block, tools, image_token)
            results.append(tool_message)
            trailing.extend(announced)
        elif kind == "tool_addition":
            name = block["tool"]["name"]
            added = [tool for tool in tools if tool.name == name]
            out.append(SystemMessage("", tools=added))
        elif kind in _SERVER_BLOCKS:
            if options.messages_web_search is not WebSearchBehavior.Drop:
                raise ConversionError("Unsupported content block: server tools are not supported")
        elif kind == "tool_use":
            raise ConversionError(
                f"messages.{index}.content: tool_use blocks may only be in `assistant` messages"
            )
    if role == "system":
        out = _merge_system(out)
    return results + out + trailing


def _merge_system(messages: list[Message]) -> list[Message]:
    texts = [m.content for m in messages if not m.tools]
    added = [tool for m in messages if m.tools for tool in m.tools]
    return [SystemMessage("\n\n".join(texts), tools=added or None)]


def _assistant(index: int, content: list, options: ConversionOptions) -> AssistantMessage:
    texts: list[str] = []
    reasoning: str | None = None
    calls: list[ToolCall] = []
    for kind, block in content:
        if kind == "text":
            texts.append(block["text"])
        elif kind == "thinking":
            reasoning = (reasoning or "") + block["thinking"]
        elif kind == "tool_use":
            calls.append(ToolCall(block["id"], block["name"], py_json(block["input"])))
        elif kind in _SERVER_BLOCKS:
            if options.messages_web_search is not WebSearchBehavior.Drop:
                raise ConversionError("Unsupported content block: server tools are not supported")
        elif kind == "image":
            raise ConversionError("Image in assistant message is not supported")
    return AssistantMessage("\n\n".join(texts), reasoning, calls or None)


def _image(source: tuple[str, dict], path: str, image_token: str) -> UserMessage:
    kind, fields = source
    if kind == "base64":
        url = f"data:{fields['media_type']};base64,{fields['data']}"
        image = DataUrlImageSource(url, path=path)
    else:
        image = image_source(fields["url"], None, path)
    return UserMessage(image_token, [image], image_token=image_token)


def _tool_result(
    index: int,
    position: int,
    block: dict,
    tools: list[ToolDefinition],
    image_token: str,
) -> tuple[ToolMessage, list[Message]]:
    content = block["content"]
    path = f"messages.{index}.content.{position}.tool_result"
    announced: list[Message] = []
    if content is None:
        return ToolMessage("", block["tool_use_id"]), announced
    if isinstance(content, str):
        return ToolMessage(content, block["tool_use_id"]), announced
    parts: list[str] = []
    images = []
    for kind, item in content:
        if kind == "text":
            parts.append(item["text"])
        elif kind == "image":
            source_kind, fields = item["source"]
            if source_kind == "base64":
                url = f"data:{fields['media_type']};base64,{fields['data']}"
                images.append(DataUrlImageSource(url, path=path))
            else:
                images.append(image_source(fields["url"], None, path))
            parts.append(image_token)
        else:
            parts.append(item["name"])
            found = [tool for tool in tools if tool.name == item["name"]]
            announced.append(SystemMessage("", tools=found))
    message = ToolMessage("\n\n".join(parts), block["tool_use_id"], images, image_token=image_token)
    return message, announced
