"""OpenAI Responses output: typed stream events, output items, and the complete response object.

Event order, item ids and the response object's fields follow spec/recipe.md §9.2.
"""

from __future__ import annotations

import json
import time
from json.encoder import encode_basestring as _quote

from deepwell.recipe.dialects.chat_output import logprobs_json
from deepwell.recipe.json_value import compact_json
from deepwell.recipe.request import ResponsesEcho
from deepwell.recipe.stream.chunks import CompletionUsage, LogprobEntry, PromptUsage
from deepwell.recipe.stream.utf8 import f32_json

# How a custom tool call's argument pieces are being streamed.
_PREFIX = 0
_RAW_INPUT = 1
_JSON_INPUT = 2
_AFTER_INPUT = 3
_INPUT_PREFIX = '{"input": "'

_INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


class ResponsesStreamEvent:
    """One Responses SSE event; its `type` is the SSE event name."""

    __slots__ = ("type", "_body", "_response", "_view", "_consumed")

    def __init__(
        self,
        type: str,
        body: str,
        response: tuple[str, str, str] | None = None,
        view: _ItemView | None = None,
    ) -> None:
        self.type = type
        # The JSON members after "type", already written, without the closing brace.
        self._body = body
        # A response event's object as (head, output, tail); an item event's item as it stands.
        self._response = response
        self._view = view
        self._consumed = False

    def to_json(self) -> str:
        if self._consumed:
            raise RuntimeError("protocol chunk has been consumed")
        return '{"type":"' + self.type + '",' + self._body + "}"


class _Item:
    """An output item: reasoning, message, function call or custom tool call."""

    __slots__ = (
        "kind",
        "id",
        "index",
        "quoted_id",
        "ids",
        "encrypted",
        "parts",
        "logprobs",
        "call_id",
        "name",
        "namespace",
        "status",
        "phase",
        "has_part",
    )

    def __init__(self, kind: str, id: str, index: int, encrypted: str) -> None:
        self.kind = kind
        self.id = id
        self.index = index
        self.quoted_id = _quote(id)
        # The members every event about this item carries.
        self.ids = f'"item_id":{self.quoted_id},"output_index":{index}'
        # A reasoning item's `encrypted_content`: "{response id}-{index}".
        self.encrypted = encrypted
        self.parts: list[str] = []
        self.logprobs: list[LogprobEntry] = []
        self.call_id = ""
        self.name = ""
        self.namespace: str | None = None
        self.status = "in_progress"
        self.phase = "final_answer"
        # Whether content_part.added was sent (reasoning and message items).
        self.has_part = False

    def part_json(self, parts: int | None = None, logprobs: int | None = None) -> str:
        text = _quote("".join(self.parts[:parts]))
        if self.kind == "reasoning":
            return '{"type":"reasoning_text","text":' + text + "}"
        return (
            '{"type":"output_text","annotations":[],"logprobs":'
            + logprobs_json(self.logprobs[:logprobs])
            + ',"text":'
            + text
            + "}"
        )

    def to_json(self, done: bool) -> str:
        return self._render(self.status, self.phase, done, None, None)

    def _render(
        self, status: str, phase: str, with_part: bool, parts: int | None, logprobs: int | None
    ) -> str:
        head = f'{{"type":"{self.kind}","id":{_quote(self.id)},"status":"{status}"'
        if self.kind == "reasoning":
            content = "[" + self.part_json(parts) + "]" if with_part else "[]"
            return (
                f'{head},"content":{content},"summary":[],'
                f'"encrypted_content":{_quote(self.encrypted)}}}'
            )
        if self.kind == "message":
            content = "[" + self.part_json(parts, logprobs) + "]" if with_part else "[]"
            return f'{head},"role":"assistant","phase":"{phase}","content":{content}}}'
        call = f',"call_id":{_quote(self.call_id)},"name":{_quote(self.name)}'
        value = _quote("".join(self.parts[:parts]))
        if self.kind == "custom_tool_call":
            return f'{head}{call},"input":{value}}}'
        namespace = "" if self.namespace is None else f',"namespace":{_quote(self.namespace)}'
        return f'{head}{call}{namespace},"arguments":{value}}}'


class _ItemView:
    """An item as the events so far describe it: what `ResponsesResponse` shows mid-stream.

    Parts only grow, so counts pin the text down; status and phase change only with
    output_item.done (spec/recipe.md §9.2, docs/recipe.md "Stream usage and accumulation").
    """

    __slots__ = ("item", "parts", "logprobs", "has_part", "done")

    def __init__(self, item: _Item, done: bool) -> None:
        self.item = item
        self.parts = len(item.parts)
        self.logprobs = len(item.logprobs)
        self.has_part = item.has_part
        self.done = done

    def to_json(self) -> str:
        item = self.item
        if self.done:
            return item._render(item.status, item.phase, item.has_part, self.parts, self.logprobs)
        return item._render("in_progress", "final_answer", self.has_part, self.parts, self.logprobs)


class _ResponseState:
    """The response object as it stands: echoed settings, status, output items, usage."""

    __slots__ = (
        "id",
        "model",
        "echo",
        "created_at",
        "completed_at",
        "status",
        "incomplete",
        "items",
        "usage",
    )

    def __init__(self, id: str, model: str, echo: ResponsesEcho, created_at: int) -> None:
        self.id = id
        self.model = model
        self.echo = echo
        self.created_at = created_at
        self.completed_at: int | None = None
        self.status = "in_progress"
        self.incomplete: str | None = None
        self.items: list[_Item] = []
        self.usage: CompletionUsage | None = None

    def snapshot(self) -> tuple[str, str, str]:
        """The object as (text before the output list, the output list, text after it)."""
        echo = self.echo
        completed_at = "null" if self.completed_at is None else str(self.completed_at)
        incomplete = "null" if self.incomplete is None else f'{{"reason":"{self.incomplete}"}}'
        usage = "null"
        if self.usage is not None:
            u = self.usage
            usage = (
                f'{{"input_tokens":{u.prompt_tokens},"input_tokens_details":'
                f'{{"cached_tokens":{u.cached_tokens}}},"output_tokens":{u.completion_tokens},'
                f'"output_tokens_details":{{"reasoning_tokens":{u.reasoning_tokens or 0}}},'
                f'"total_tokens":{u.prompt_tokens + u.completion_tokens}}}'
            )
        head = (
            f'{{"id":{_quote(self.id)},"object":"response","created_at":{self.created_at},'
            f'"status":"{self.status}","background":false,"completed_at":{completed_at},'
            f'"content_filters":null,"error":null,"frequency_penalty":0.0,'
            f'"incomplete_details":{incomplete},"instructions":{_json(echo.instructions)},'
            f'"max_output_tokens":{_json(echo.max_output_tokens)},"max_tool_calls":null,'
            f'"model":{_quote(self.model)},"moderation":null,"output":'
        )
        output = "[" + ",".join(item.to_json(True) for item in self.items) + "]"
        tail = (
            f',"parallel_tool_calls":true,"presence_penalty":0.0,"previous_response_id":null,'
            f'"prompt_cache_key":null,"prompt_cache_retention":null,'
            f'"reasoning":{compact_json(echo.reasoning)},"safety_identifier":null,'
            f'"service_tier":"default","store":false,"temperature":{f32_json(echo.temperature)},'
            f'"text":{compact_json(echo.text)},"tool_choice":{compact_json(echo.tool_choice)},'
            f'"tools":{compact_json(echo.tools)},"top_logprobs":{echo.top_logprobs},'
            f'"top_p":{f32_json(echo.top_p)},"truncation":"disabled","usage":{usage},'
            f'"user":{_json(echo.user)},"metadata":{{}}}}'
        )
        return head, output, tail


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


class ResponsesChunkGenerator:
    """Turns parser output into Responses events (obtain via `ResponsesRequest.chunk_generator`)."""

    def __init__(self, id: str, model: str, thinking_mode: bool = False) -> None:
        self._id = id
        self._model = model
        self.thinking_mode = thinking_mode
        # None: no map from conversion; the reference then splits every name at its first
        # `::`, whatever the model.
        self._namespaces: dict[str, tuple[str, str]] | None = None
        self._echo = ResponsesEcho()
        self._custom: set[str] = set()
        self._sequence = 0
        self._state: _ResponseState | None = None
        self._open: _Item | None = None
        self._custom_mode = _PREFIX
        self._prefix = ""

    def with_namespace_tool_map(
        self, namespace_tool_map: dict[str, tuple[str, str]]
    ) -> ResponsesChunkGenerator:
        self._namespaces = dict(namespace_tool_map)
        return self

    def with_echo(self, echo: ResponsesEcho) -> ResponsesChunkGenerator:
        self._echo = echo
        self._custom = {
            tool["name"]
            for tool in echo.tools
            if isinstance(tool, dict) and tool.get("type") == "custom"
        }
        return self

    def _event(
        self, type: str, body: str, item: _Item, out: list, tail: str = "", done: bool = False
    ) -> None:
        # Members are in key order; `tail` holds those that sort after "sequence_number".
        out.append(
            ResponsesStreamEvent(
                type,
                f'{body},"sequence_number":{self._sequence}{tail}',
                view=_ItemView(item, done),
            )
        )
        self._sequence += 1

    def _response_event(self, type: str, out: list) -> None:
        snapshot = self._state.snapshot()
        out.append(
            ResponsesStreamEvent(
                type,
                f'"response":{"".join(snapshot)},"sequence_number":{self._sequence}',
                snapshot,
            )
        )
        self._sequence += 1

    def start(self, prompt_usage: PromptUsage, system_fingerprint: str | None, out: list) -> None:
        self._state = _ResponseState(self._id, self._model, self._echo, int(time.time()))
        self._response_event("response.created", out)
        self._response_event("response.in_progress", out)

    def _open_item(self, kind: str, prefix: str) -> _Item:
        index = len(self._state.items)
        item = _Item(kind, f"{prefix}_{self._id}_{index}", index, f"{self._id}-{index}")
        self._state.items.append(item)
        self._open = item
        return item

    def _announce(self, item: _Item, out: list) -> None:
        self._event(
            "response.output_item.added",
            f'"item":{item.to_json(False)},"output_index":{item.index}',
            item,
            out,
        )

    def _part_added(self, item: _Item, out: list) -> None:
        item.has_part = True
        part = (
            '{"type":"reasoning_text","text":""}'
            if item.kind == "reasoning"
            else '{"type":"output_text","annotations":[],"logprobs":[],"text":""}'
        )
        self._event(
            "response.content_part.added",
            f'"content_index":0,{item.ids},"part":{part}',
            item,
            out,
        )

    def _close(self, out: list, status: str = "completed", before_call: bool = False) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        item.status = status
        ids = item.ids
        text = _quote("".join(item.parts))
        if item.kind == "reasoning":
            self._event(
                "response.reasoning_text.done",
                f'"content_index":0,{ids}',
                item,
                out,
                f',"text":{text}',
            )
            self._event(
                "response.content_part.done",
                f'"content_index":0,{ids},"part":{item.part_json()}',
                item,
                out,
            )
        elif item.kind == "message":
            if before_call:
                item.phase = "commentary"
            self._event(
                "response.output_text.done",
                f'"content_index":0,"item_id":{item.quoted_id},'
                f'"logprobs":{logprobs_json(item.logprobs)},"output_index":{item.index}',
                item,
                out,
                f',"text":{text}',
            )
            self._event(
                "response.content_part.done",
                f'"content_index":0,{ids},"part":{item.part_json()}',
                item,
                out,
            )
        elif item.kind == "function_call":
            self._event(
                "response.function_call_arguments.done", f'"arguments":{text},{ids}', item, out
            )
        else:
            self._event("response.custom_tool_call_input.done", f'"input":{text},{ids}', item, out)
        self._event(
            "response.output_item.done",
            f'"item":{item.to_json(True)},"output_index":{item.index}',
            item,
            out,
            done=True,
        )

    def reasoning(self, text: str, logprobs: list[LogprobEntry] | None, out: list) -> None:
        item = self._open
        if item is None or item.kind != "reasoning":
            self._close(out)
            item = self._open_item("reasoning", "rs")
            self._announce(item, out)
            self._part_added(item, out)
        item.parts.append(text)
        self._event(
            "response.reasoning_text.delta",
            f'"content_index":0,"delta":{_quote(text)},{item.ids}',
            item,
            out,
        )

    def content(self, text: str, logprobs: list[LogprobEntry] | None, out: list) -> None:
        item = self._open
        if item is None or item.kind != "message":
            self._close(out)
            item = self._open_item("message", "msg")
            self._announce(item, out)
            self._part_added(item, out)
        item.parts.append(text)
        entries = "[]"
        if logprobs:
            item.logprobs.extend(logprobs)
            entries = logprobs_json(logprobs)
        self._event(
            "response.output_text.delta",
            f'"content_index":0,"delta":{_quote(text)},"item_id":{item.quoted_id}'
            f',"logprobs":{entries},"output_index":{item.index}',
            item,
            out,
        )

    def tool_call(self, index: int, call_id: str, name: str, out: list) -> None:
        self._close(out, before_call=True)
        if name in self._custom:
            item = self._open_item("custom_tool_call", "ctc")
        else:
            item = self._open_item("function_call", "fc")
            namespaces = self._namespaces
            if namespaces is None:
                namespace, separator, local = name.partition("::")
                if separator:
                    item.namespace, name = namespace, local
            elif name in namespaces:
                item.namespace, name = namespaces[name]
        item.call_id = call_id
        item.name = name
        self._custom_mode = _PREFIX
        self._prefix = ""
        self._announce(item, out)

    def arguments(self, index: int, piece: str, is_string_value: bool, out: list) -> None:
        item = self._open
        ids = item.ids
        if item.kind == "function_call":
            if is_string_value:
                piece = _quote(piece)[1:-1]
            item.parts.append(piece)
            self._event(
                "response.function_call_arguments.delta",
                f'"delta":{_quote(piece)},{ids}',
                item,
                out,
            )
            return
        # A custom tool whose arguments open with a string `input` streams that string raw
        # and nothing else; any other arguments stream as JSON text (spec/recipe.md §9.2).
        mode = self._custom_mode
        if mode == _PREFIX:
            text = _quote(piece)[1:-1] if is_string_value else piece
            self._prefix += text
            if self._prefix == _INPUT_PREFIX:
                self._custom_mode = _RAW_INPUT
            elif not _INPUT_PREFIX.startswith(self._prefix):
                self._custom_mode = _JSON_INPUT
                self._custom_delta(item, self._prefix, ids, out)
        elif mode == _RAW_INPUT:
            if is_string_value:
                self._custom_delta(item, piece, ids, out)
            elif piece == '"':
                self._custom_mode = _AFTER_INPUT
        elif mode == _JSON_INPUT:
            self._custom_delta(item, _quote(piece)[1:-1] if is_string_value else piece, ids, out)

    def _custom_delta(self, item: _Item, text: str, ids: str, out: list) -> None:
        if not text:
            # Unlike function arguments, a custom tool's input never streams an empty delta.
            return
        item.parts.append(text)
        self._event(
            "response.custom_tool_call_input.delta", f'"delta":{_quote(text)},{ids}', item, out
        )

    def finish(
        self, reason: str, stop_sequence: str | None, usage: CompletionUsage, out: list
    ) -> None:
        incomplete = _INCOMPLETE_REASONS.get(reason)
        self._close(out, "incomplete" if incomplete else "completed")
        state = self._state
        state.status = "incomplete" if incomplete else "completed"
        state.incomplete = incomplete
        state.completed_at = int(time.time())
        state.usage = usage
        self._response_event("response.incomplete" if incomplete else "response.completed", out)


class ResponsesResponse:
    """The non-streaming response object, built from the events accumulated so far.

    The latest response event gives everything but the output; the output is what the item
    events after it have described, so a stream cut short shows its items as they stood.
    """

    def __init__(
        self, id: str, model: str, created: int, prompt_tokens: int, prompt_cache_hit_tokens: int
    ) -> None:
        self._head, self._output, self._tail = _ResponseState(
            id, model, ResponsesEcho(), created
        ).snapshot()
        # Item views by output index, from item events after the latest response event.
        self._views: list[_ItemView] = []

    @staticmethod
    def sse_event_name(event: ResponsesStreamEvent) -> str | None:
        return event.type

    @staticmethod
    def sse_done_data() -> str | None:
        return None

    def accumulate(self, event: ResponsesStreamEvent) -> None:
        if event._consumed:
            raise RuntimeError("protocol chunk has been consumed")
        event._consumed = True
        if event._response is not None:
            self._head, self._output, self._tail = event._response
            self._views = []
            return
        view = event._view
        index = view.item.index
        views = self._views
        if index < len(views):
            views[index] = view
        else:
            views.append(view)

    def to_json(self) -> str:
        if not self._views:
            return self._head + self._output + self._tail
        output = "[" + ",".join(view.to_json() for view in self._views) + "]"
        return self._head + output + self._tail
