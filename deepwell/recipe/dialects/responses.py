"""OpenAI Responses requests (`/v1/responses`) → ConversationRequest, namespace map and echo.

Input items, tools (functions, namespaces, apply_patch, server tools), errors: spec §6.3, §15.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepwell.recipe import conversion as rules
from deepwell.recipe.conversation import (
    AssistantMessage,
    Conversation,
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
    APPLY_PATCH_DESCRIPTION_V4,
    APPLY_PATCH_NAME,
    APPLY_PATCH_PARAMETERS,
)
from deepwell.recipe.dialects.body import BodyError, Struct, Tagged
from deepwell.recipe.dialects.images import (
    UNSUPPORTED_IMAGE_TEXT,
    BlockText,
    ImagePolicy,
    image_source,
)
from deepwell.recipe.dialects.protocol_request import ProtocolRequest
from deepwell.recipe.dialects.request_options import (
    RequestedFormat,
    RequestedSampling,
    request_options,
    response_schemas,
)
from deepwell.recipe.dialects.responses_output import ResponsesChunkGenerator
from deepwell.recipe.errors import ConversionError
from deepwell.recipe.json_value import JsonValue, compact_json
from deepwell.recipe.options import ModelVersion
from deepwell.recipe.request import ConversationRequest, ResponsesEcho

SERVER_TOOLS = (
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "tool_search",
    "file_search",
)
# Only these server tools are refused under `WebSearchBehavior.Reject`; others are dropped.
WEB_SEARCH_TOOLS = ("web_search", "web_search_2025_08_26")
_UNSUPPORTED_DOCUMENT = "[Unsupported Document]"

_BLOCK = Tagged(
    "ResponsesContentBlock",
    "type",
    {
        "input_text": Struct("ResponsesInputText", {"text": b.string}, ("text",)),
        "output_text": Struct("ResponsesOutputText", {"text": b.string}, ("text",)),
        # The reference declares `detail` second and `#[serde(default)]`: positionally an
        # image reads [image_url, detail, file_id], and a sequence may stop before `detail`
        # only to fail at `file_id` (the tag is not one of the elements).
        "input_image": Struct(
            "ResponsesInputImage",
            {
                "image_url": b.optional(b.string),
                "detail": b.optional(b.variants("low", "high", "original", "auto")),
                "file_id": b.optional(b.string),
            },
            defaults=("detail",),
        ),
        "input_file": Struct("ResponsesInputFile", {}),
    },
    newtypes=("input_image",),
)


@b.accepts(lambda: b.any_of(b.string, b.sequence(_BLOCK)))
def _content(value: JsonValue) -> str | list:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [_BLOCK(item) for item in value]
    raise BodyError("content should be a string or a list of content blocks")


_OUTPUT_BLOCK = Tagged(
    "ResponsesToolCallOutputItem",
    "type",
    {k: v for k, v in _BLOCK.readers.items() if k != "output_text"},
    newtypes=("input_image",),
)


@b.accepts(lambda: b.any_of(b.string, b.sequence(_OUTPUT_BLOCK)))
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
        {"call_id": b.optional(b.string), "output": _output},
        ("output",),
    ),
    "custom_tool_call": Struct(
        "ResponsesCustomToolCall",
        {"call_id": b.string, "input": b.string, "name": b.string},
        ("call_id", "input", "name"),
    ),
    "custom_tool_call_output": Struct(
        "ResponsesCustomToolCallOutput",
        {"call_id": b.string, "output": b.optional(_output)},
        ("call_id",),
    ),
    "reasoning": Struct(
        "ResponsesReasoningItem",
        {
            "content": b.optional(
                b.sequence(Struct("ResponsesReasoningContent", {"text": b.string}, ("text",)))
            )
        },
    ),
}


# Known items that carry nothing for the prompt (but still close the window for outputs).
_IGNORED_ITEMS = ("item_reference", "web_search_call")


@b.accepts(
    lambda: b.any_of(
        Tagged(
            "ResponsesInputItem",
            "type",
            {**_ITEMS, **dict.fromkeys(_IGNORED_ITEMS, Struct("ResponsesIgnoredItem", {}))},
            other=Struct("ResponsesUnknownItem", {}),
        ),
        _MESSAGE,
    )
)
def _item(value: JsonValue) -> tuple[str, dict] | None:
    """One input item, or None for an unknown kind (skipped without a trace)."""
    if isinstance(value, dict):
        if "type" in value:
            kind = value["type"]
            if not isinstance(kind, str):
                raise b.invalid_type(kind, "variant identifier")
            if kind in _IGNORED_ITEMS:
                return kind, {}
            reader = _ITEMS.get(kind)
            # Typed items are an internally tagged enum in the reference.
            return None if reader is None else (kind, b.read_buffered(reader, value))
        if "role" in value:
            return "message", _MESSAGE(value)
    raise BodyError("invalid input item")


@b.accepts(lambda: b.any_of(b.string, b.sequence(_item)))
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
# Only the name of a custom tool is read (apply_patch is the one supported).
_CUSTOM_TOOL = Struct("ResponsesCustomTool", {"name": b.string}, ("name",))
_NAMESPACE_MEMBER = Tagged(
    "ResponsesNamespaceTool",
    "type",
    {"function": _FUNCTION_TOOL, "custom": _CUSTOM_TOOL},
    indexed=True,
    newtypes=("function",),
)
_SERVER_TOOL = Struct("ResponsesServerTool", {})
_WEB_SEARCH_TOOL = Struct(
    "ResponsesWebSearchTool",
    {
        "search_context_size": b.optional(b.variants("low", "medium", "high")),
        "user_location": b.optional(
            Struct(
                "ResponsesUserLocation",
                dict.fromkeys(("city", "country", "region", "timezone"), b.optional(b.string)),
            )
        ),
    },
)
_TOOL_SEARCH_TOOL = Struct(
    "ResponsesToolSearchTool",
    {
        "execution": b.optional(b.variants("client", "server")),
        "description": b.optional(b.string),
        "parameters": b.any_value,
    },
)
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
        **dict.fromkeys(WEB_SEARCH_TOOLS, _WEB_SEARCH_TOOL),
        "tool_search": _TOOL_SEARCH_TOOL,
    },
    # Tool types this dialect does not know are accepted and dropped.
    other=_SERVER_TOOL,
    newtypes=("function", *WEB_SEARCH_TOOLS),
)
_CHOICE_MESSAGE = "expected one of `none`, `auto`, `required` or a tool choice object"
_NAMED_CHOICE = Struct("ResponsesNamedToolChoice", {"name": b.string}, ("name",))


@b.accepts(
    lambda: b.any_of(
        b.variants("none", "auto", "required"),
        Struct(
            "ResponsesNamedToolChoice",
            {"type": b.variants("function", "custom"), "name": b.string},
            ("type", "name"),
        ),
        Struct("ResponsesWebSearchChoice", {"type": b.variants(*WEB_SEARCH_TOOLS)}, ("type",)),
    )
)
def _tool_choice(value: JsonValue) -> JsonValue:
    if value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and "type" in value:
        kind = value["type"]
        if not isinstance(kind, str):
            raise b.invalid_type(kind, "variant identifier")
        if kind in ("function", "custom"):
            _NAMED_CHOICE(value)
            return value
        if kind in WEB_SEARCH_TOOLS:
            return value
        raise b.unknown_variant(kind, ("function", *WEB_SEARCH_TOOLS, "custom"))
    raise BodyError(_CHOICE_MESSAGE)


_FORMAT = Tagged(
    "ResponsesTextFormat",
    "type",
    {
        "text": Struct("ResponsesTextFormatText", {}),
        "json_schema": Struct(
            "ResponsesTextFormatJsonSchema",
            # Written as an array, serde reads the fields in the reference's order.
            {
                "name": b.string,
                "schema": b.any_value,
                "description": b.optional(b.string),
                "strict": b.optional(b.boolean),
            },
            ("name", "schema"),
        ),
        "json_object": Struct("ResponsesTextFormatJsonObject", {}),
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
                {
                    "effort": b.optional(_EFFORT),
                    "summary": b.optional(b.variants("auto", "concise", "detailed")),
                    "generate_summary": b.optional(b.variants("auto", "concise", "detailed")),
                },
            )
        ),
        "text": b.optional(
            Struct(
                "ResponsesTextConfig",
                {
                    "format": _FORMAT,
                    "verbosity": b.optional(b.variants("low", "medium", "high")),
                },
                defaults=("format",),
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
        separator = _separator(rules.resolve_model(self.model, options))
        tools = self._fields["tools"] or []
        return _declare_tools(tools, separator, options, check_kinds=False)[1]

    def echo(self) -> ResponsesEcho:
        return self._echo

    def convert(self, options: ConversionOptions) -> ConversationRequest:
        return _convert(self._take(), self._echo, options)

    @staticmethod
    def chunk_generator(
        conversation_request: ConversationRequest, id: str, model: str
    ) -> ResponsesChunkGenerator:
        request = conversation_request
        generator = ResponsesChunkGenerator(id, model, request.conversation.thinking_mode)
        if request.namespace_tool_map is not None:
            generator.with_namespace_tool_map(request.namespace_tool_map)
        return generator.with_echo(request.echo)


def _separator(version: ModelVersion | None) -> str:
    # V4-Pro spells namespaced tools `ns__member`; only V4.1-Flash uses `ns::member` (§15.1).
    return "__" if version is ModelVersion.DeepseekV4Pro else "::"


def _echo(f: dict[str, Any]) -> ResponsesEcho:
    """The request's settings as the response object spells them (spec §9.2)."""
    reasoning = f["reasoning"] or {"effort": None, "summary": None, "generate_summary": None}
    text = f["text"] or {"format": None, "verbosity": None}
    tools = [_tool_echo(kind, tool) for kind, tool in f["tools"] or []]
    return ResponsesEcho(
        instructions=f["instructions"],
        max_output_tokens=f["max_output_tokens"],
        temperature=1.0 if f["temperature"] is None else f["temperature"],
        top_p=1.0 if f["top_p"] is None else f["top_p"],
        top_logprobs=f["top_logprobs"] or 0,
        user=f["user"],
        reasoning={
            "effort": reasoning["effort"],
            "summary": reasoning["summary"] or reasoning["generate_summary"],
        },
        text={"format": _format_echo(text["format"]), "verbosity": text["verbosity"]},
        tool_choice=_tool_choice_echo(f["tool_choice"]),
        tools=[tool for tool in tools if tool is not None],
    )


def _format_echo(value: tuple[str, dict] | None) -> JsonValue:
    if value is None:
        return {"type": "text"}
    kind, fields = value
    if kind != "json_schema":
        return {"type": kind}
    keys = ("name", "schema", "description", "strict")
    return {"type": kind, **{key: fields[key] for key in keys}}


def _tool_choice_echo(value: JsonValue) -> JsonValue:
    if value is None:
        return "auto"
    if isinstance(value, str):
        return value
    if value["type"] in ("function", "custom"):
        return {"type": value["type"], "name": value["name"]}
    return {"type": value["type"]}


def _function_echo(tool: dict) -> dict:
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool["description"],
        "parameters": tool["parameters"],
        "strict": tool["strict"],
    }


def _tool_echo(kind: str, tool: dict) -> JsonValue:
    """A declared tool as echoed; None for those the response leaves out."""
    if kind == "function":
        return _function_echo(tool)
    if kind == "custom":
        return {"type": "custom", "name": tool["name"]}
    if kind == "namespace":
        return {
            "type": "namespace",
            "name": tool["name"],
            "description": tool["description"],
            "tools": [_tool_echo(k, t) for k, t in tool["tools"]],
        }
    if kind in WEB_SEARCH_TOOLS:
        location = tool["user_location"]
        return {
            "type": kind,
            "search_context_size": tool["search_context_size"],
            "user_location": location if location is None else dict(location),
        }
    if kind == "tool_search":
        return {"type": kind, **tool}
    return None


def _convert(
    f: dict[str, Any], echo: ResponsesEcho, options: ConversionOptions
) -> ConversationRequest:
    version = rules.resolve_model(f["model"], options)
    declared, namespace_map = _declare_tools(f["tools"] or [], _separator(version), options)
    messages = _input_messages(f, version, options)
    choice, named = _choice(f["tool_choice"], options)
    effort = (f["reasoning"] or {}).get("effort")
    thinking, conversation_effort = rules.resolve_thinking(None, effort, options)
    rules.apply_reasoning_history(
        messages,
        thinking,
        options,
        "The `reasoning_text` in the thinking mode must be passed back to the API.",
        # Server tools, dropped, do not count.
        tools_declared=bool(declared),
    )
    # With tool_choice `none` the tools are dropped unchecked (names were checked above).
    tools = [] if f["tool_choice"] == "none" else _tool_definitions(declared)

    format_kind, schema, strict = _text_format(f["text"])
    selection = rules.apply_tool_choice(tools, choice, named, thinking)
    constraint_schema, output_schema = response_schemas(format_kind, schema, strict)
    if format_kind == "json_object" and not rules.mentions_json([m.content for m in messages]):
        raise ConversionError(
            "Response input messages must contain the word 'json' in some form to use "
            "'text.format' of type 'json_object'."
        )
    # Only the tools a named tool_choice keeps must agree on strictness.
    rules.check_strict_consistency(selection.tools)
    if any(tool.strict for tool in selection.tools) and format_kind != "text":
        raise ConversionError("response_format should not be used with tools")
    rules.check_temperature(f["temperature"])
    rules.check_top_p(f["top_p"])
    rules.check_max_tokens(f["max_output_tokens"], rules.max_tokens_bound(thinking, options))
    conversation = Conversation(
        messages,
        thinking_mode=thinking,
        tools=selection.tools,
        tool_choice=selection.tool_choice,
        reasoning_effort=conversation_effort,
        response_format="json_object" if format_kind == "json_object" else "text",
        response_schema=schema,
    )
    top_logprobs = f["top_logprobs"]
    sampling = RequestedSampling(
        f["max_output_tokens"],
        f["temperature"],
        f["top_p"],
        logprobs=top_logprobs is not None,
        top_logprobs=top_logprobs,
    )
    inference, parsing = request_options(
        version=version,
        thinking=thinking,
        selection=selection,
        sampling=sampling,
        output=RequestedFormat(format_kind, constraint_schema),
        stop=[],
        options=options,
    )
    return ConversationRequest(
        conversation,
        version,
        inference_options=inference,
        parsing_options=parsing,
        stream=bool(f["stream"]),
        namespace_tool_map=namespace_map,
        echo=echo,
        output_schema=output_schema,
    )


def _input_messages(
    f: dict[str, Any], version: ModelVersion, options: ConversionOptions
) -> list[Message]:
    """`instructions` as a leading system message, then the input string or items."""
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
        images = ImagePolicy.for_model(version, options)
        developer_is_system = version is not ModelVersion.DeepseekV4Pro
        messages.extend(_items(raw_input, images, _separator(version), developer_is_system))
    return messages


@dataclass
class _DeclaredTool:
    """A conversation tool named and described, its parameter schema not yet checked."""

    name: str
    description: str | None
    parameters: JsonValue
    strict: bool | None
    checked: bool = False
    # Namespace members are not part of the request-level uniqueness check.
    member: bool = False


def _declare_tools(
    declared: list[tuple[str, dict]],
    separator: str,
    options: ConversionOptions,
    *,
    check_kinds: bool = True,
) -> tuple[list[_DeclaredTool], dict[str, tuple[str, str]]]:
    """Names checked; namespace members flattened and mapped.

    With `check_kinds`, unsupported custom tools and rejected server tools fail too.
    """
    tools: list[_DeclaredTool] = []
    namespace_map: dict[str, tuple[str, str]] = {}
    # Namespaced names yield to declared ones; clashes get `_1`, `_2`, … appended.
    taken = {tool["name"] for kind, tool in declared if kind in ("function", "custom")}
    for index, (kind, tool) in enumerate(declared):
        if kind == "function":
            rules.check_tool_name(tool["name"], f"tools[{index}].name")
            tools.append(
                _DeclaredTool(tool["name"], tool["description"], tool["parameters"], tool["strict"])
            )
        elif kind == "custom":
            if tool["name"] != APPLY_PATCH_NAME and check_kinds:
                raise ConversionError(
                    f"Unsupported custom tool: '{tool['name']}'. Only 'apply_patch' is supported."
                )
            tools.append(
                _DeclaredTool(
                    APPLY_PATCH_NAME,
                    APPLY_PATCH_DESCRIPTION_V4 if separator == "__" else APPLY_PATCH_DESCRIPTION,
                    APPLY_PATCH_PARAMETERS,
                    None,
                    checked=True,
                )
            )
        elif kind == "namespace":
            rules.check_tool_name(tool["name"], f"tools[{index}].name")
            for member in _namespace_members(index, tool):
                name = _free_name(f"{tool['name']}{separator}{member['name']}", taken)
                description = member["description"]
                # V4.1 prefixes the namespace's description; V4-Pro keeps the member's own.
                if tool["description"] and separator == "::":
                    description = f"{tool['description']}\n{description or ''}"
                tools.append(
                    _DeclaredTool(
                        name, description, member["parameters"], member["strict"], member=True
                    )
                )
                namespace_map[name] = (tool["name"], member["name"])
        elif kind == "tool_search" and tool["execution"] == "client" and separator == "::":
            # V4.1 runs a client-side tool search as a function the client answers.
            tools.append(
                _DeclaredTool("tool_search", tool["description"], tool["parameters"], None)
            )
        elif (
            check_kinds
            and kind in WEB_SEARCH_TOOLS
            and options.responses_web_search is WebSearchBehavior.Reject
        ):
            raise ConversionError("Server tools are not supported")
    return tools, namespace_map


def _free_name(name: str, taken: set[str]) -> str:
    candidate, suffix = name, 0
    while candidate in taken:
        suffix += 1
        candidate = f"{name}_{suffix}"
    taken.add(candidate)
    return candidate


def _namespace_members(index: int, namespace: dict) -> list[dict]:
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
    return members


def _tool_definitions(declared: list[_DeclaredTool]) -> list[ToolDefinition]:
    tools = []
    seen: set[str] = set()
    for tool in declared:
        if not tool.member:
            rules.claim_tool_name(tool.name, seen)
        parameters = tool.parameters
        if not tool.checked:
            parameters = rules.prepare_parameters(tool.name, parameters, tool.strict)
        tools.append(ToolDefinition(tool.name, tool.description, parameters, tool.strict))
    return tools


def _choice(value: JsonValue, options: ConversionOptions) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        return value, None
    if value["type"] in ("function", "custom"):
        return "required", value["name"]
    # A web search choice is a server tool too: ignored (auto) or refused, like the tools.
    if options.responses_web_search is WebSearchBehavior.Reject:
        raise ConversionError("Server tools are not supported")
    return "auto", None


def _text_format(text: dict | None) -> tuple[str, JsonValue, bool | None]:
    """(format kind, json schema, strict) of `text.format`."""
    if text is None or text["format"] is None:
        return "text", None, None
    kind, fields = text["format"]
    return kind, fields.get("schema"), fields.get("strict")


def _blocks(
    content: str | list | None,
    path: str,
    part: str,
    images: ImagePolicy,
    *,
    assistant: bool = False,
) -> BlockText:
    """A content list's text (blocks joined by blank lines) and its images.

    `part` names the list in error paths (`content` or `output`).
    """
    blocks = BlockText(images)
    if content is None:
        # A custom tool's output may be left out: an empty result.
        blocks.text("")
        return blocks
    if isinstance(content, str):
        blocks.text(content)
        return blocks
    if images.supported:
        _check_image_blocks(content, f"{path}.{part}")
    for kind, block in content:
        if kind in ("input_text", "output_text"):
            blocks.text(block["text"])
        elif kind == "input_file":
            blocks.text(_UNSUPPORTED_DOCUMENT)
        elif not images.supported:
            # V4-Pro: an image is a stand-in text, never checked (spec §15.9).
            blocks.text(UNSUPPORTED_IMAGE_TEXT)
        else:
            if assistant:
                raise ConversionError(f"{path}: Image in assistant message is unsupported")
            blocks.image(image_source(block["image_url"], block["detail"], path, images))
    return blocks


def _check_image_blocks(content: list, where: str) -> None:
    """Every input_image names exactly one source, and not a file_id (checked before URLs)."""
    for position, (kind, block) in enumerate(content):
        if kind != "input_image":
            continue
        at = f"{where}[{position}]"
        # An empty image_url counts as none.
        url, file_id = block["image_url"] or None, block["file_id"]
        if url is None and file_id is None:
            raise ConversionError(f"{at}: input_image must have image_url or file_id")
        if url is not None and file_id is not None:
            raise ConversionError(f"{at}: input_image cannot have both image_url and file_id")
        if file_id is not None:
            raise ConversionError(
                f"{at}: file_id is not supported. Pass the image as a base64 data url instead."
            )


class _Turn:
    """One assistant turn being folded from adjacent items, and the tool outputs after it."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.reasoning: list[str] | None = None
        self.calls: list[ToolCall] = []
        self.outputs: list[ToolMessage] = []

    def message(self) -> AssistantMessage:
        reasoning = None if self.reasoning is None else "\n".join(self.reasoning)
        # The reference keeps a turn's calls keyed (and so ordered) by call id.
        calls = sorted(self.calls, key=lambda call: call.id)
        return AssistantMessage("\n\n".join(self.texts), reasoning, calls or None)


def _items(
    items: list, images: ImagePolicy, separator: str, developer_is_system: bool
) -> list[Message]:
    """Fold the item list into messages: adjacent reasoning, text and calls form one turn.

    Calls must be answered before the next message or reasoning item (or the end).
    """
    folder = _ItemFolder(images, separator, developer_is_system)
    for index, entry in enumerate(items):
        if entry is None:
            continue
        kind, item = entry
        if kind in _IGNORED_ITEMS:
            folder.require_answers()
            continue
        path = f"input[{index}]"
        if item.get("call_id") == "":
            raise ConversionError(
                f"Invalid '{path}.call_id': empty string. Expected a string with minimum "
                "length 1, but got an empty string instead."
            )
        if kind == "message":
            folder.message(item, path)
        elif kind == "reasoning":
            folder.reasoning(item)
        elif kind in ("function_call", "custom_tool_call"):
            folder.call(kind, item)
        else:
            folder.output(item, path)
    folder.require_answers()
    folder.close()
    return folder.messages


class _ItemFolder:
    """The messages folded so far, the assistant turn still open, and the calls awaiting
    their outputs; one method per item kind."""

    def __init__(self, images: ImagePolicy, separator: str, developer_is_system: bool) -> None:
        self.images = images
        self.separator = separator
        self.developer_is_system = developer_is_system
        self.messages: list[Message] = []
        self.turn: _Turn | None = None
        self.pending: list[str] = []
        self.called: set[str] = set()
        self.answered: set[str] = set()

    def require_answers(self) -> None:
        if self.pending:
            raise ConversionError(f"No tool output found for tool call {self.pending[0]}.")

    def close(self) -> None:
        """End the open turn: its message, then its outputs in the order of its calls."""
        if self.turn is not None:
            message = self.turn.message()
            order = [call.id for call in message.tool_calls or []]
            self.messages.append(message)
            outputs = sorted(self.turn.outputs, key=lambda m: order.index(m.tool_call_id))
            self.messages.extend(outputs)
        self.turn = None

    def current(self, *, fresh_if: bool) -> _Turn:
        """The open turn; a new one if the open one has outputs or `fresh_if`."""
        if self.turn is not None and (self.turn.outputs or fresh_if):
            self.close()
        if self.turn is None:
            self.turn = _Turn()
        return self.turn

    def message(self, item: dict, path: str) -> None:
        self.require_answers()
        role = item["role"]
        images = self.images
        if role == "assistant":
            folded = self.current(fresh_if=bool(self.turn and self.turn.calls))
            content = _blocks(item["content"], path, "content", images, assistant=True).content()
            # Adjacent assistant texts join with blank lines; empty ones leave no trace.
            if content:
                folded.texts.append(content)
            return
        self.close()
        blocks = _blocks(item["content"], path, "content", images)
        content, sources = blocks.content(), blocks.sources
        # V4-Pro hears developer messages as the user's words; system stays system.
        if role == "user" or (role == "developer" and not self.developer_is_system):
            message = UserMessage(content, sources, image_token=images.token)
        else:
            message = SystemMessage(content, sources, image_token=images.token)
        self.messages.append(blocks.attach(message))

    def reasoning(self, item: dict) -> None:
        self.require_answers()
        texts = [part["text"] for part in item["content"] or [] if part["text"]]
        if texts:
            turn = self.turn
            folded = self.current(fresh_if=bool(turn and (turn.texts or turn.calls)))
            folded.reasoning = (folded.reasoning or []) + texts

    def call(self, kind: str, item: dict) -> None:
        call_id = item["call_id"]
        if call_id in self.called:
            raise ConversionError(f"Duplicate 'call_id': {call_id}.")
        self.called.add(call_id)
        self.pending.append(call_id)
        if kind == "function_call":
            name = item["name"]
            if item["namespace"] is not None:
                name = f"{item['namespace']}{self.separator}{name}"
            arguments = item["arguments"]
        else:
            name = item["name"]
            arguments = compact_json({"input": item["input"]})
        self.current(fresh_if=False).calls.append(ToolCall(call_id, name, arguments))

    def output(self, item: dict, path: str) -> None:
        call_id = item["call_id"]
        images = self.images
        if call_id is None:
            # An output naming no call stands alone, like a message.
            self.require_answers()
            self.close()
            blocks = _blocks(item["output"], path, "output", images)
            output = ToolMessage(blocks.content(), None, blocks.sources, image_token=images.token)
            self.messages.append(blocks.attach(output))
            return
        blocks = _blocks(item["output"], path, "output", images)
        if call_id in self.answered:
            raise ConversionError(f"Duplicate tool output for call_id: {call_id}.")
        if call_id not in self.pending:
            raise ConversionError(f"No tool call found for tool output with call_id {call_id}.")
        self.pending.remove(call_id)
        self.answered.add(call_id)
        output = ToolMessage(blocks.content(), call_id, blocks.sources, image_token=images.token)
        # A pending call lies in the open turn: messages and reasoning require answers first.
        self.turn.outputs.append(blocks.attach(output))
