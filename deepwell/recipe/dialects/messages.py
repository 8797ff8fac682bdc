"""Anthropic Messages requests (`/v1/messages`) → ConversationRequest.

Blocks, tool_use/tool_result pairing, deferred tools and errors per spec §6.4.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from deepwell.recipe import conversion as rules
from deepwell.recipe.conversation import (
    AssistantMessage,
    Conversation,
    DataUrlImageSource,
    ImageSource,
    Message,
    SystemMessage,
    ToolCall,
    ToolDefinition,
    ToolMessage,
    UrlImageSource,
    UserMessage,
)
from deepwell.recipe.conversion import ConversionOptions, WebSearchBehavior
from deepwell.recipe.dialects import body as b
from deepwell.recipe.dialects.body import BodyError, Struct, Tagged
from deepwell.recipe.dialects.images import (
    UNSUPPORTED_IMAGE_TEXT,
    BlockText,
    ImagePolicy,
    padded_base64,
)
from deepwell.recipe.dialects.messages_output import MessagesChunkGenerator
from deepwell.recipe.dialects.protocol_request import ProtocolRequest
from deepwell.recipe.dialects.request_options import (
    RequestedFormat,
    RequestedSampling,
    request_options,
)
from deepwell.recipe.errors import ConversionError
from deepwell.recipe.json_value import JsonValue, py_json
from deepwell.recipe.options import ModelVersion
from deepwell.recipe.request import ConversationRequest
from deepwell.recipe.schema import check_parameters_schema, check_response_schema

_BASE64_MEDIA_TYPES = ("image/jpeg", "image/jpg", "image/png", "image/gif", "image/webp")
_IMAGE_SOURCE = Tagged(
    "MessagesImageSource",
    "type",
    {
        "base64": Struct(
            "MessagesBase64Source",
            {"media_type": b.variants(*_BASE64_MEDIA_TYPES), "data": b.string},
            ("media_type", "data"),
        ),
        "url": Struct("MessagesUrlSource", {"url": b.string}, ("url",)),
        "file": Struct("MessagesFileSource", {"file_id": b.string}, ("file_id",)),
    },
    indexed=True,
)
_IMAGE = Struct("MessagesImageBlock", {"source": _IMAGE_SOURCE}, ("source",))
_DOCUMENT = Struct(
    "MessagesDocumentBlock",
    {"source": Struct("MessagesDocumentSource", {"media_type": b.optional(b.string)})},
    ("source",),
)
_TEXT = Struct("MessagesTextBlock", {"text": b.string}, ("text",))
_RESULT_BLOCK = Tagged(
    "MessagesToolResultBlock",
    "type",
    {
        "text": _TEXT,
        "image": _IMAGE,
        "document": _DOCUMENT,
        "tool_reference": Struct(
            "MessagesToolReferenceBlock", {"tool_name": b.string}, ("tool_name",)
        ),
    },
)


@b.accepts(lambda: b.any_of(b.string, b.sequence(_RESULT_BLOCK)))
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
        "image": _IMAGE,
        "document": _DOCUMENT,
        "thinking": Struct(
            "MessagesThinkingBlock",
            # The reference declares the signature first (it matters in sequences).
            {"signature": b.optional(b.string), "thinking": b.string},
            ("thinking",),
        ),
        "server_tool_use": Struct(
            "MessagesServerToolUseBlock",
            {"id": b.string, "name": b.string, "input": b.any_value},
            ("id", "name", "input"),
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
        "web_search_tool_result": Struct(
            "MessagesWebSearchToolResultBlock",
            {"tool_use_id": b.string, "content": b.any_value},
            ("tool_use_id", "content"),
        ),
        "tool_addition": Struct(
            "MessagesToolAdditionBlock",
            {
                "tool": Tagged(
                    "MessagesToolReference",
                    "type",
                    {
                        "tool_reference": Struct(
                            "MessagesToolReference", {"name": b.string}, ("name",)
                        )
                    },
                    indexed=True,
                )
            },
            ("tool",),
        ),
    },
)


@b.accepts(lambda: b.any_of(b.string, b.sequence(_BLOCK)))
def _content(value: JsonValue) -> str | list:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [_BLOCK(item) for item in value]
    raise BodyError("expected a string or a list")


_ROLE = b.variants("user", "assistant", "system")


@b.accepts(
    lambda: b.json_schema(
        Struct("MessagesMessage", {"role": _ROLE, "content": _content}, ("role", "content"))
    )
)
def _message(value: JsonValue) -> tuple[str, str | list]:
    # Adjacently tagged: `role` names the variant, `content` carries it.
    if isinstance(value, list):
        # As a sequence: [role, content].
        if value and not isinstance(value[0], str):
            raise b.invalid_type(value[0], "variant identifier")
        role = _ROLE(value[0]) if value else None
        if len(value) < 2:
            raise BodyError(
                f"invalid length {len(value)}, expected adjacently tagged enum MessagesMessage"
            )
        content = _content(value[1])
        if len(value) > 2:
            raise BodyError(f"invalid length {len(value)}, expected fewer elements in array")
        return role, content
    if not isinstance(value, dict):
        raise b.invalid_type(value, "adjacently tagged enum MessagesMessage")
    if "role" not in value:
        raise BodyError("missing field `role`")
    role = _ROLE(value["role"])
    if "content" not in value:
        raise BodyError("missing field `content`")
    return role, _content(value["content"])


_SYSTEM_BLOCK = Tagged("MessagesSystemBlock", "type", {"text": _TEXT})


@b.accepts(lambda: b.any_of(b.string, b.sequence(_SYSTEM_BLOCK)))
def _system(value: JsonValue) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n\n".join(_SYSTEM_BLOCK(item)[1]["text"] for item in value)
    raise BodyError("expected a string or a list")


_TOOL_FIELDS = {
    "name": b.in_field("name", b.string),
    "description": b.in_field("description", b.optional(b.string)),
    "defer_loading": b.in_field("defer_loading", b.optional(b.boolean)),
}


@b.accepts(
    lambda: b.any_of(
        Struct("MessagesTool", {**_TOOL_FIELDS, "input_schema": b.any_value}, ("name",)),
        Struct("MessagesServerTool", {"type": b.string, "name": b.optional(b.string)}, ("type",)),
    )
)
def _tool(value: JsonValue) -> dict:
    """A tool entry; `type` marks server tools, `strict` is not read (spec §14)."""
    if isinstance(value, dict) and "type" in value:
        # A typed (server) tool: its name, when given, must be a string.
        kind = b.string(value["type"])
        return {"type": kind, "name": b.optional(b.string)(value.get("name"))}
    if not isinstance(value, dict) or "name" not in value:
        raise BodyError("missing field `name`")
    tool = {key: reader(value.get(key)) for key, reader in _TOOL_FIELDS.items()}
    return {"type": None, **tool, "input_schema": value.get("input_schema")}


_PARALLEL = b.optional(b.boolean)
_TOOL_CHOICE = Tagged(
    "MessagesToolChoice",
    "type",
    {
        "auto": Struct("MessagesToolChoiceAuto", {"disable_parallel_tool_use": _PARALLEL}),
        "any": Struct("MessagesToolChoiceAny", {"disable_parallel_tool_use": _PARALLEL}),
        "tool": Struct(
            "MessagesToolChoiceTool",
            {"name": b.string, "disable_parallel_tool_use": _PARALLEL},
            ("name",),
        ),
        "none": Struct("MessagesToolChoiceNone", {}),
    },
)
_EFFORT = b.variants("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
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
                    "type": b.variants("adaptive", "enabled", "disabled"),
                    "budget_tokens": b.optional(b.u64),
                },
                ("type",),
            )
        ),
        "output_config": b.optional(
            Struct(
                "MessagesOutputConfig",
                {"effort": b.optional(_EFFORT)},
                # `format` is read only with ConversionOptions.with_structured_output.
                extensions={"format": b.optional(b.any_value)},
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


def _output_schema(config: dict | None, options: ConversionOptions) -> JsonValue:
    """The JSON schema of `output_config.format` (Anthropic structured outputs), or None.

    The reference ignores the field; deepwell reads it only when the options ask for it.
    """
    if not options.structured_output or config is None or config["format"] is None:
        return None
    fmt = config["format"]
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise ConversionError("output_config.format: type must be 'json_schema'")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise ConversionError("output_config.format.schema: must be a JSON schema object")
    check_response_schema(schema)
    return schema


def _convert(f: dict[str, Any], options: ConversionOptions) -> ConversationRequest:
    version = rules.resolve_model(f["model"], options)
    # Only V4.1 loads tools lazily; V4-Pro treats deferred tools as ordinary ones.
    deferral = version is ModelVersion.DeepseekV41Flash
    declared = _declared_tools(f["tools"] or [], options, deferral)
    messages = _conversation_messages(f, declared, version, options)
    switch = f["thinking"]
    enabled = None if switch is None else switch["type"] != "disabled"
    effort = (f["output_config"] or {}).get("effort")
    thinking, conversation_effort = rules.resolve_thinking(enabled, effort, options)
    rules.apply_reasoning_history(
        messages,
        thinking,
        options,
        "The `content[].thinking` in the thinking mode must be passed back to the API.",
        # Dropped web search tools count here too (unlike in Responses).
        tools_declared=bool(f["tools"]),
    )
    selection = _tool_selection(f, declared, thinking)
    schema = _output_schema(f["output_config"], options)
    stop = f["stop_sequences"] or []
    rules.check_stop(stop)
    rules.check_temperature(f["temperature"])
    rules.check_top_p(f["top_p"])
    max_tokens = _max_tokens(f["max_tokens"], thinking, options)
    conversation = Conversation(
        messages,
        thinking_mode=thinking,
        tools=selection.tools,
        tool_choice=selection.tool_choice,
        reasoning_effort=conversation_effort,
        response_schema=schema,
    )
    inference, parsing = request_options(
        version=version,
        thinking=thinking,
        selection=selection,
        sampling=RequestedSampling(max_tokens, f["temperature"], f["top_p"]),
        output=RequestedFormat("text" if schema is None else "json_schema", schema),
        stop=stop,
        options=options,
    )
    return ConversationRequest(
        conversation,
        version,
        inference_options=inference,
        parsing_options=parsing,
        stream=bool(f["stream"]),
        output_schema=schema,
    )


def _conversation_messages(
    f: dict[str, Any], declared: list[dict], version: ModelVersion, options: ConversionOptions
) -> list[Message]:
    """The top-level `system` and the messages, each tool result paired with its call."""
    raw = f["messages"]
    if not raw:
        raise ConversionError("messages: at least one message is required")
    images = ImagePolicy.for_model(version, options)
    messages: list[Message] = []
    if f["system"] is not None:
        messages.append(SystemMessage(f["system"]))
    context = _Context([_definition(tool) for tool in declared], images, options, version)
    pairing = _Pairing()
    for index, (role, content) in enumerate(raw):
        messages.extend(_convert_message(index, role, content, context, pairing))
    pairing.close()
    return messages


def _tool_selection(f: dict[str, Any], declared: list[dict], thinking: bool) -> rules.ToolSelection:
    """The tools the model may call under `tool_choice`."""
    choice = f["tool_choice"]
    kind = "auto" if choice is None else choice[0]
    # With tool_choice `none` the tools are dropped unchecked (names were checked before).
    tools = [] if kind == "none" else _tool_definitions(declared)
    named = choice[1]["name"] if kind == "tool" else None
    # `any` only asks for some tool call; the reference treats it as `auto` (spec §6.4).
    return rules.apply_tool_choice(
        tools,
        {"any": "auto", "tool": "required"}.get(kind, kind),
        named,
        thinking,
        declared=bool(f["tools"]),
    )


def _max_tokens(max_tokens: int | None, thinking: bool, options: ConversionOptions) -> int | None:
    if max_tokens is None:
        return None
    # Messages clamps an over-large max_tokens instead of refusing it (spec §6.1).
    bound = rules.max_tokens_bound(thinking, options)
    max_tokens = min(max_tokens, bound)
    rules.check_max_tokens(max_tokens, bound)
    return max_tokens


def _declared_tools(declared: list[dict], options: ConversionOptions, deferral: bool) -> list[dict]:
    """Function tools with checked names; typed (server) tools dropped or refused."""
    kept: list[dict] = []
    for index, tool in enumerate(declared):
        kind = tool["type"]
        if kind is not None:
            # Typed tools run on Anthropic's side; only web search may be dropped by option.
            if kind.startswith("web_search") and (
                options.messages_web_search is WebSearchBehavior.Drop
            ):
                continue
            raise ConversionError(f"tools[{index}]: server tools are not supported")
        rules.check_tool_name(tool["name"], f"tools[{index}].name")
        kept.append({**tool, "defer_loading": deferral and bool(tool["defer_loading"])})
    if kept and all(tool["defer_loading"] for tool in kept):
        raise ConversionError(
            "tools: at least one tool must have defer_loading=false. All tools cannot be deferred."
        )
    return kept


def _definition(tool: dict) -> ToolDefinition:
    # `strict` is accepted but not applied in this dialect (spec §14).
    return ToolDefinition(
        tool["name"], tool["description"], tool["input_schema"], None, bool(tool["defer_loading"])
    )


def _tool_definitions(declared: list[dict]) -> list[ToolDefinition]:
    """The request's tools, each checked: a repeated name, then its input schema."""
    seen: set[str] = set()
    for tool in declared:
        rules.claim_tool_name(tool["name"], seen)
        check_parameters_schema(tool["name"], tool["input_schema"])
    return [_definition(tool) for tool in declared]


class _Pairing:
    """tool_use ids awaiting their tool_result blocks, checked block by block in request
    order as the reference does (spec §6.4): results answer the previous assistant's calls,
    and any other content before they are all answered fails."""

    def __init__(self) -> None:
        self.owner = -1
        self.awaited: list[str] = []
        self.answered: list[str] = []

    def require_answered(self, where: str) -> None:
        missing = [i for i in self.awaited if i not in self.answered]
        if missing:
            raise _unanswered(where, missing)

    def answer(self, index: int, position: int, tool_use_id: str) -> None:
        if tool_use_id not in self.awaited:
            raise ConversionError(
                f"unexpected `messages.{index}.content.{position}: tool_use_id` found in "
                f"`tool_result` blocks: {tool_use_id}. Each `tool_result` block must have "
                "a corresponding `tool_use` block in the previous message."
            )
        if tool_use_id in self.answered:
            raise ConversionError(
                f"messages.{index}.content.{position}: each tool_use must have a single "
                f"result. Found multiple `tool_result` blocks with id: {tool_use_id}"
            )
        self.answered.append(tool_use_id)

    def close(self) -> None:
        """The message after the calls ended: what it left unanswered is the caller's fault
        (written with no space after the colon)."""
        self.require_answered(f"messages.{self.owner}:")
        self.awaited, self.answered = [], []

    def await_calls(self, index: int, ids: list[str]) -> None:
        self.owner, self.awaited, self.answered = index, ids, []


def _unanswered(where: str, ids: list[str]) -> ConversionError:
    # The reference keeps the ids in a sorted set: listed in byte order.
    listed = ", ".join(sorted(ids, key=lambda i: i.encode("utf-8")))
    return ConversionError(
        f"{where}`tool_use` ids were found without `tool_result` blocks immediately after: "
        f"{listed}. Each `tool_use` block must have a corresponding `tool_result` "
        "block in the next message."
    )


def _misplaced(index: int, kind: str) -> ConversionError:
    """A block in a message of a role that may not hold it."""
    if kind == "thinking":
        return ConversionError(
            f"messages.{index}.content: thinking blocks may only be in `assistant` messages"
        )
    # A server tool call counts as a tool_use; its result has its own name.
    name = "tool_use" if kind == "server_tool_use" else kind
    role = {"tool_result": "user", "tool_addition": "system"}.get(kind, "assistant")
    return ConversionError(f"messages.{index}: `{name}` blocks can only be in `{role}` messages")


# Blocks only an assistant message may hold, and those only a user / system message may.
_ASSISTANT_ONLY = ("thinking", "tool_use", "server_tool_use", "web_search_tool_result")


@dataclass(frozen=True)
class _Context:
    """What converting one message needs from the request."""

    tools: list[ToolDefinition]
    images: ImagePolicy
    options: ConversionOptions
    version: ModelVersion

    @property
    def deferral(self) -> bool:
        """Only V4.1 loads tools lazily; V4-Pro treats deferred tools as ordinary ones."""
        return self.version is ModelVersion.DeepseekV41Flash


def _convert_message(
    index: int, role: str, content: str | list, ctx: _Context, pairing: _Pairing
) -> list[Message]:
    """One message, its blocks checked in order; an assistant's calls then await results."""
    if role != "user":
        pairing.require_answered(f"messages.{index}: ")
        pairing.close()
    if isinstance(content, list) and not content and role != "system":
        raise ConversionError(f"messages.{index}: all messages must have non-empty content")
    if role == "assistant":
        if isinstance(content, str):
            return [AssistantMessage(content)]
        message = _assistant(index, content, ctx)
        pairing.await_calls(index, [call.id for call in message.tool_calls or []])
        return [message]
    if role == "system":
        if isinstance(content, str):
            return _system(SystemMessage(content), ctx.version)
        return _system(_system_message(index, content, ctx), ctx.version)
    if isinstance(content, str):
        pairing.require_answered(f"messages.{index}: ")
        pairing.close()
        return [UserMessage(content)]
    messages = _user(index, content, ctx, pairing)
    pairing.close()
    return messages


def _user(index: int, content: list, ctx: _Context, pairing: _Pairing) -> list[Message]:
    images = ctx.images
    results: list[Message] = []
    out: list[Message] = []
    announced: list[Message] = []
    for position, (kind, block) in enumerate(content):
        if kind == "tool_result":
            pairing.answer(index, position, block["tool_use_id"])
            where = f"messages.{index}.content.{position}"
            message, added = _tool_result(block, where, ctx.tools, images, ctx.deferral)
            results.append(message)
            announced.extend(added)
            continue
        if kind in _ASSISTANT_ONLY or kind == "tool_addition":
            raise _misplaced(index, kind)
        # Content before every call is answered breaks the call/result pairing.
        pairing.require_answered(f"messages.{index}: ")
        path = f"messages.{index}.content[{position}]"
        if kind == "text":
            out.append(UserMessage(block["text"]))
        elif kind == "image":
            out.append(_image_message(block["source"], path, images))
        else:
            out.append(UserMessage(_unsupported_document(block)))
    return results + out + announced


def _system(message: SystemMessage, version: ModelVersion) -> list[Message]:
    """A system-role message in place; V4-Pro gets its text as a user-side reminder instead."""
    if version is not ModelVersion.DeepseekV4Pro:
        return [message]
    if not message.content:
        return []
    return [UserMessage(f"<system-reminder>\n{message.content}\n</system-reminder>")]


def _system_message(index: int, content: list, ctx: _Context) -> SystemMessage:
    """Text, images and documents joined by blank lines; tool_additions announce tools."""
    blocks = BlockText(ctx.images)
    added: list[ToolDefinition] = []
    for position, (kind, block) in enumerate(content):
        if kind in _ASSISTANT_ONLY or kind == "tool_result":
            raise _misplaced(index, kind)
        if kind == "text":
            blocks.text(block["text"])
        elif kind == "image":
            _block_image(
                blocks, block, f"messages.{index}.content[{position}]", f"messages.{index}"
            )
        elif kind == "document":
            blocks.text(_unsupported_document(block))
        else:
            name = block["tool"][1]["name"]
            found = [tool for tool in ctx.tools if tool.name == name]
            if not found:
                raise ConversionError(
                    f"messages.{index}.content.{position}: `tool_addition` references unknown "
                    f"tool '{name}'"
                )
            added.extend(found)
    message = SystemMessage(
        blocks.content(), blocks.sources, tools=added or None, image_token=ctx.images.token
    )
    return blocks.attach(message)


def _assistant(index: int, content: list, ctx: _Context) -> AssistantMessage:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for position, (kind, block) in enumerate(content):
        if kind in ("tool_result", "tool_addition"):
            raise _misplaced(index, kind)
        if kind in ("text", "image", "document") and calls:
            # Text after a call would separate it from its results.
            raise _unanswered(f"messages.{index}.{position}: ", [call.id for call in calls])
        if kind == "text":
            texts.append(block["text"])
        elif kind == "image":
            if ctx.images.supported:
                _image(block["source"], f"messages.{index}.content[{position}]", ctx.images)
                raise ConversionError("Image in assistant message is unsupported")
            texts.append(UNSUPPORTED_IMAGE_TEXT)
        elif kind == "document":
            texts.append(_unsupported_document(block))
        elif kind == "thinking":
            thoughts.append(block["thinking"])
        elif kind == "tool_use":
            if any(call.id == block["id"] for call in calls):
                raise ConversionError(
                    f"messages.{index}.content.{position}: `tool_use` ids must be unique"
                )
            calls.append(ToolCall(block["id"], block["name"], py_json(block["input"])))
        elif ctx.options.messages_web_search is not WebSearchBehavior.Drop:
            raise ConversionError("Unsupported content block: server tools are not supported")
    reasoning = "\n\n".join(thoughts) if thoughts else None
    return AssistantMessage(_join_after_content(texts), reasoning, calls or None)


def _join_after_content(parts: list[str]) -> str:
    """Parts joined by blank lines, the separator only once some text has been written: empty
    parts before the first text leave no trace, later ones do."""
    content = ""
    for part in parts:
        content = f"{content}\n\n{part}" if content else part
    return content


def _unsupported_document(block: dict) -> str:
    media_type = block["source"]["media_type"]
    return f"[Unsupported document type: {'unknown' if media_type is None else media_type}]"


def _block_image(blocks: BlockText, block: dict, path: str, source_path: str) -> None:
    """An image among a system message's blocks: a placeholder, or V4-Pro's stand-in text."""
    if blocks.images.supported:
        blocks.image(_image(block["source"], path, blocks.images, source_path))
    else:
        blocks.text(UNSUPPORTED_IMAGE_TEXT)


def _image_message(source: tuple[str, dict], path: str, images: ImagePolicy) -> UserMessage:
    if not images.supported:
        # V4-Pro: an image is a stand-in text, never checked (spec §15.9).
        return UserMessage(UNSUPPORTED_IMAGE_TEXT)
    return UserMessage(images.token, [_image(source, path, images)], image_token=images.token)


def _image(
    source: tuple[str, dict], path: str, images: ImagePolicy, source_path: str | None = None
) -> ImageSource:
    """The block's image source; `path` names it in errors, `source_path` (by default the
    same) is the path the source carries."""
    kind, fields = source
    where = path
    path = path if source_path is None else source_path
    if kind == "base64":
        if not padded_base64(fields["data"]):
            raise ConversionError(f"{where}: base64 decode error")
        return DataUrlImageSource(f"data:{fields['media_type']};base64,{fields['data']}", path=path)
    if kind == "file":
        raise ConversionError(
            f"{where}: file_id is not supported. Pass the image as a base64 data url instead."
        )
    url = fields["url"]
    schemes = ("http://", "https://", "file://") if images.local_files else ("http://", "https://")
    if not url.lower().startswith(schemes):
        raise ConversionError(f"{where}: invalid url: {json.dumps(url, ensure_ascii=False)}")
    return UrlImageSource(url, path=path)


def _tool_result(
    block: dict, where: str, tools: list[ToolDefinition], images: ImagePolicy, deferral: bool
) -> tuple[ToolMessage, list[Message]]:
    """`where` is the block's path (`messages.N.content.M`)."""
    path = f"{where}.tool_result"
    content = block["content"]
    tool_use_id = block["tool_use_id"]
    if content is None or isinstance(content, str):
        return ToolMessage(content or "", tool_use_id), []
    blocks = BlockText(images)
    announced: list[Message] = []
    for kind, item in content:
        if kind == "text":
            blocks.text(item["text"])
        elif kind == "image":
            if images.supported:
                blocks.image(_image(item["source"], path, images))
            else:
                blocks.text(UNSUPPORTED_IMAGE_TEXT)
        elif kind == "document":
            blocks.text(_unsupported_document(item))
        else:
            # A tool_reference loads a deferred tool: its name is the result, and (where
            # tools load lazily) a system message announces the tool after the results.
            name = item["tool_name"]
            found = [tool for tool in tools if tool.name == name]
            if not found:
                raise ConversionError(
                    f"{where}: tool reference '{name}' not found in available tools"
                )
            blocks.text(name)
            if deferral:
                announced.append(SystemMessage("", tools=found))
    message = blocks.attach(
        ToolMessage(blocks.content(), tool_use_id, blocks.sources, image_token=images.token)
    )
    return message, announced
