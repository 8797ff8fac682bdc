"""The internal conversation every dialect converts into, and every encoding renders.

Class, argument and property names mirror deepseek_recipe 0.2.0 (spec/recipe.md §1, §2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from deepwell.recipe.encoding.special_tokens import SpecialToken
from deepwell.recipe.json_value import JsonValue, check_json_value

IMAGE_DETAILS = ("low", "high", "original", "auto")


class ToolCall:
    """One function call made by the assistant; `arguments` is the raw (unvalidated) text."""

    __slots__ = ("id", "name", "arguments")

    def __init__(self, id: str, name: str, arguments: str) -> None:
        self.id = id
        self.name = name
        self.arguments = arguments

    def __repr__(self) -> str:
        return f"ToolCall(id={self.id!r}, name={self.name!r}, arguments={self.arguments!r})"


class ToolDefinition:
    """A function the model may call; `parameters` is a JSON schema (or None)."""

    __slots__ = ("name", "description", "parameters", "strict", "defer_loading")

    def __init__(
        self,
        name: str,
        description: str | None = None,
        parameters: JsonValue = None,
        strict: bool | None = None,
        defer_loading: bool = False,
    ) -> None:
        self.name = name
        self.description = description
        self.parameters = None if parameters is None else check_json_value(parameters)
        self.strict = strict
        self.defer_loading = defer_loading

    def __repr__(self) -> str:
        return f"ToolDefinition(name={self.name!r}, description={self.description!r})"


class ImageSource:
    """Where an image comes from; rendered prompts carry these in message order."""

    kind: ClassVar[str]
    __slots__ = ("detail", "path")

    def __init__(self, detail: str = "high", *, path: str = "") -> None:
        if detail not in IMAGE_DETAILS:
            raise ValueError(
                f'invalid detail "{detail}"; expected "low", "high", "original", or "auto"'
            )
        self.detail = detail
        self.path = path

    data_url: str | None = None
    url: str | None = None
    data: bytes | None = None


class DataUrlImageSource(ImageSource):
    kind = "data_url"
    __slots__ = ("data_url",)

    def __init__(self, data_url: str, detail: str = "high", *, path: str = "") -> None:
        super().__init__(detail, path=path)
        self.data_url = data_url


class UrlImageSource(ImageSource):
    kind = "url"
    __slots__ = ("url",)

    def __init__(self, url: str, detail: str = "high", *, path: str = "") -> None:
        super().__init__(detail, path=path)
        self.url = url


class BytesImageSource(ImageSource):
    kind = "bytes"
    __slots__ = ("data",)

    def __init__(self, data: bytes, detail: str = "high", *, path: str = "") -> None:
        super().__init__(detail, path=path)
        self.data = bytes(data)


class Message:
    """Base of the five roles. Properties absent from a role read as None / False / []."""

    role: ClassVar[str]
    content: str
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    prefix: bool = False
    image_sources: list[ImageSource] = []
    # Code-point spans of `content` that are real image placeholders, fixed at construction:
    # the first N occurrences of the image token, N = len(image_sources).
    image_spans: tuple[tuple[int, int], ...] = ()

    def _set_images(self, sources: Sequence[ImageSource] | None, image_token: str | None) -> None:
        if image_token is not None and image_token == "":
            raise ValueError("image_token must not be empty")
        self.image_sources = list(sources or [])
        token = image_token if image_token is not None else SpecialToken.Image.default_str()
        spans: list[tuple[int, int]] = []
        start = 0
        while len(spans) < len(self.image_sources):
            at = self.content.find(token, start)
            if at < 0:
                break
            spans.append((at, at + len(token)))
            start = at + len(token)
        self.image_spans = tuple(spans)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(content={self.content!r})"


class SystemMessage(Message):
    role = "system"

    def __init__(
        self,
        content: str,
        image_sources: Sequence[ImageSource] | None = None,
        tools: Sequence[ToolDefinition] | None = None,
        *,
        image_token: str | None = None,
    ) -> None:
        self.content = content
        self.tools = None if tools is None else list(tools)
        self._set_images(image_sources, image_token)


class UserMessage(Message):
    role = "user"

    def __init__(
        self,
        content: str,
        image_sources: Sequence[ImageSource] | None = None,
        *,
        image_token: str | None = None,
    ) -> None:
        self.content = content
        self._set_images(image_sources, image_token)


class AssistantMessage(Message):
    role = "assistant"

    def __init__(
        self,
        content: str,
        reasoning_content: str | None = None,
        tool_calls: Sequence[ToolCall] | None = None,
        prefix: bool = False,
    ) -> None:
        self.content = content
        self.reasoning_content = reasoning_content
        self.tool_calls = None if tool_calls is None else list(tool_calls)
        self.prefix = prefix


class ToolMessage(Message):
    role = "tool"

    def __init__(
        self,
        content: str,
        tool_call_id: str | None = None,
        image_sources: Sequence[ImageSource] | None = None,
        *,
        image_token: str | None = None,
    ) -> None:
        self.content = content
        self.tool_call_id = tool_call_id
        self._set_images(image_sources, image_token)


class LatestReminderMessage(Message):
    role = "latest_reminder"

    def __init__(self, content: str) -> None:
        self.content = content


TOOL_CHOICES = ("auto", "none", "required")
REASONING_EFFORTS = ("low", "high", "xhigh", "max")


class Conversation:
    """Messages plus the switches that change how they are rendered."""

    __slots__ = (
        "messages",
        "thinking_mode",
        "tools",
        "tool_choice",
        "reasoning_effort",
        "response_format",
        "response_schema",
        "response_regex",
    )

    def __init__(
        self,
        messages: Sequence[Message] | None = None,
        *,
        thinking_mode: bool = True,
        tools: Sequence[ToolDefinition] | None = None,
        tool_choice: str = "auto",
        reasoning_effort: str | None = None,
        response_format: str = "text",
        response_schema: JsonValue = None,
        response_regex: str | None = None,
    ) -> None:
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(
                f'invalid tool_choice "{tool_choice}"; expected "auto", "none", or "required"'
            )
        if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(
                f'invalid reasoning_effort "{reasoning_effort}"; '
                'expected "low", "high", "xhigh", or "max"'
            )
        if response_format not in ("text", "json_object"):
            raise ValueError(
                f'invalid response_format "{response_format}"; expected "text" or "json_object"'
            )
        if response_format == "json_object" and (
            response_schema is not None or response_regex is not None
        ):
            raise ValueError(
                'response_format "json_object" cannot be combined with '
                "response_schema or response_regex"
            )
        if response_schema is not None and response_regex is not None:
            raise ValueError("response_schema and response_regex cannot be combined")
        if response_schema is not None:
            response_format = "json_schema"
            response_schema = check_json_value(response_schema)
        elif response_regex is not None:
            response_format = "regex"
        self.messages = list(messages or [])
        self.thinking_mode = thinking_mode
        self.tools = list(tools or [])
        self.tool_choice = tool_choice
        self.reasoning_effort = reasoning_effort
        self.response_format = response_format
        self.response_schema = response_schema
        self.response_regex = response_regex

    def __repr__(self) -> str:
        return f"Conversation(messages={self.messages!r}, thinking_mode={self.thinking_mode})"
