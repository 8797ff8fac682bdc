"""Anthropic Messages output: stream events (blocks, deltas, ping) and the complete message.

Block order, stop reasons and usage follow spec/recipe.md §9.3.
"""

from __future__ import annotations

from json.encoder import encode_basestring as _quote

from deepwell.recipe.encoding.template_json import parse_arguments
from deepwell.recipe.json_value import JsonValue, compact_json
from deepwell.recipe.stream.chunks import CompletionUsage, LogprobEntry, PromptUsage

_STOP_REASONS = {
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "length": "max_tokens",
    "content_filter": "refusal",
}


def _usage_json(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> str:
    return (
        f'{{"input_tokens":{max(0, prompt_tokens - cached_tokens)},"cache_creation_input_tokens":0,'
        f'"cache_read_input_tokens":{cached_tokens},"output_tokens":{output_tokens},'
        f'"service_tier":"standard"}}'
    )


class MessagesStreamEvent:
    """One Messages SSE event; its `type` is the SSE event name."""

    __slots__ = ("type", "_body", "_payload", "_consumed")

    def __init__(
        self, type: str, body: str, payload: _Block | _Delta | _Final | str | int | None = None
    ) -> None:
        self.type = type
        # JSON members after "type" (leading comma included), without the closing brace.
        self._body = body
        # What accumulation needs: the start's usage, the block a start event opens, how far
        # a delta took its block, the index a stop closes, the final stop reason.
        self._payload = payload
        self._consumed = False

    def to_json(self) -> str:
        if self._consumed:
            raise RuntimeError("protocol chunk has been consumed")
        return '{"type":"' + self.type + '"' + self._body + "}"


class _Block:
    __slots__ = ("kind", "parts", "signature", "call_id", "name")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.parts: list[str] = []
        self.signature = ""
        self.call_id = ""
        self.name = ""

    def to_json(
        self, parts: int | None = None, signature: str | None = None, stopped: bool = True
    ) -> str:
        """The block as it stands, or with only its first `parts` deltas and `signature`.

        A tool_use block's input is parsed only once the block stopped; `{}` before.
        """
        text = "".join(self.parts[:parts])
        if self.kind == "thinking":
            signature = self.signature if signature is None else signature
            return (
                f'{{"type":"thinking","thinking":{_quote(text)},"signature":{_quote(signature)}}}'
            )
        if self.kind == "text":
            return f'{{"type":"text","text":{_quote(text)}}}'
        return (
            f'{{"type":"tool_use","id":{_quote(self.call_id)},"name":{_quote(self.name)},'
            f'"input":{compact_json(_tool_input(text)) if stopped else "{}"}}}'
        )


class _Delta:
    """A block after one delta event: its part count, or the signature a signature_delta set."""

    __slots__ = ("index", "parts", "signature")

    def __init__(self, index: int, parts: int, signature: str | None) -> None:
        self.index = index
        self.parts = parts
        self.signature = signature


def _tool_input(arguments: str) -> JsonValue:
    """The streamed arguments as an object; text that strict JSON does not read as one gives `{}`."""
    parsed = parse_arguments(arguments)
    return {} if parsed is None else parsed


class _Final:
    """What `message_delta` reports, kept for the accumulated message."""

    __slots__ = ("stop_reason", "stop_sequence", "usage")

    def __init__(self, stop_reason: str, stop_sequence: str | None, usage: str) -> None:
        self.stop_reason = stop_reason
        self.stop_sequence = stop_sequence
        self.usage = usage


class MessagesChunkGenerator:
    """Turns parser output into Messages events; thinking mode opens a thinking block first."""

    def __init__(self, id: str, model: str, thinking_mode: bool) -> None:
        self._id = id
        self._model = model
        self.thinking_mode = thinking_mode
        self._signature = id
        self._open: _Block | None = None
        self._index = -1

    def with_signature(self, signature: str) -> MessagesChunkGenerator:
        self._signature = signature
        return self

    def start(self, prompt_usage: PromptUsage, system_fingerprint: str | None, out: list) -> None:
        usage = _usage_json(prompt_usage.prompt_tokens, prompt_usage.prompt_cache_hit_tokens, 0)
        out.append(
            MessagesStreamEvent(
                "message_start",
                f',"message":{{"id":{_quote(self._id)},"type":"message","role":"assistant",'
                f'"model":{_quote(self._model)},"content":[],"stop_reason":null,'
                f'"stop_sequence":null,"usage":{usage}}}',
                usage,
            )
        )
        if self.thinking_mode:
            self._open_block(_Block("thinking"), out)

    def _open_block(self, block: _Block, out: list) -> None:
        self._index += 1
        self._open = block
        if block.kind == "thinking":
            start = '{"type":"thinking","thinking":"","signature":""}'
        elif block.kind == "text":
            start = '{"type":"text","text":""}'
        else:
            start = (
                f'{{"type":"tool_use","id":{_quote(block.call_id)},"name":{_quote(block.name)},'
                '"input":{}}'
            )
        out.append(
            MessagesStreamEvent(
                "content_block_start",
                f',"index":{self._index},"content_block":{start}',
                block,
            )
        )
        if self._index == 0:
            out.append(MessagesStreamEvent("ping", ""))

    def _close(self, out: list) -> None:
        block = self._open
        if block is None:
            return
        self._open = None
        if block.kind == "thinking":
            block.signature = self._signature
            out.append(
                MessagesStreamEvent(
                    "content_block_delta",
                    f',"index":{self._index},"delta":{{"type":"signature_delta",'
                    f'"signature":{_quote(self._signature)}}}',
                    _Delta(self._index, len(block.parts), self._signature),
                )
            )
        out.append(
            MessagesStreamEvent("content_block_stop", f',"index":{self._index}', self._index)
        )

    def _delta(self, kind: str, field: str, text: str, out: list) -> None:
        block = self._open
        block.parts.append(text)
        out.append(
            MessagesStreamEvent(
                "content_block_delta",
                f',"index":{self._index},"delta":{{"type":"{kind}","{field}":{_quote(text)}}}',
                _Delta(self._index, len(block.parts), None),
            )
        )

    def reasoning(self, text: str, logprobs: list[LogprobEntry] | None, out: list) -> None:
        if self._open is None or self._open.kind != "thinking":
            self._close(out)
            self._open_block(_Block("thinking"), out)
        self._delta("thinking_delta", "thinking", text, out)

    def content(self, text: str, logprobs: list[LogprobEntry] | None, out: list) -> None:
        if self._open is None or self._open.kind != "text":
            self._close(out)
            self._open_block(_Block("text"), out)
        self._delta("text_delta", "text", text, out)

    def tool_call(self, index: int, call_id: str, name: str, out: list) -> None:
        self._close(out)
        block = _Block("tool_use")
        block.call_id = call_id
        block.name = name
        self._open_block(block, out)

    def arguments(self, index: int, piece: str, is_string_value: bool, out: list) -> None:
        if is_string_value:
            piece = _quote(piece)[1:-1]
        self._delta("input_json_delta", "partial_json", piece, out)

    def finish(
        self, reason: str, stop_sequence: str | None, usage: CompletionUsage, out: list
    ) -> None:
        self._close(out)
        stop_reason = "stop_sequence" if stop_sequence is not None else _STOP_REASONS[reason]
        usage_json = _usage_json(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
        out.append(
            MessagesStreamEvent(
                "message_delta",
                f',"delta":{{"stop_reason":"{stop_reason}","stop_sequence":'
                f"{'null' if stop_sequence is None else _quote(stop_sequence)}}},"
                f'"usage":{usage_json}',
                _Final(stop_reason, stop_sequence, usage_json),
            )
        )
        out.append(MessagesStreamEvent("message_stop", ""))


class MessagesResponse:
    """The non-streaming message: the blocks as far as the accumulated events took them.

    As the reference does, usage comes from `message_start` until `message_delta` replaces
    it, and a block shows only the deltas accumulated so far (docs/recipe.md).
    """

    def __init__(
        self, id: str, model: str, created: int, prompt_tokens: int, prompt_cache_hit_tokens: int
    ) -> None:
        self._id = id
        self._model = model
        # [block, deltas accumulated, signature so far, stopped] in index order.
        self._blocks: list[list] = []
        self._final: _Final | None = None
        self._usage = _usage_json(prompt_tokens, prompt_cache_hit_tokens, 0)

    @staticmethod
    def sse_event_name(event: MessagesStreamEvent) -> str | None:
        return event.type

    @staticmethod
    def sse_done_data() -> str | None:
        return None

    def accumulate(self, event: MessagesStreamEvent) -> None:
        if event._consumed:
            raise RuntimeError("protocol chunk has been consumed")
        event._consumed = True
        payload = event._payload
        if event.type == "content_block_start":
            self._blocks.append([payload, 0, "", False])
        elif event.type == "content_block_delta":
            entry = self._blocks[payload.index]
            entry[1] = payload.parts
            if payload.signature is not None:
                entry[2] = payload.signature
        elif event.type == "content_block_stop":
            self._blocks[payload][3] = True
        elif event.type == "message_start":
            self._usage = payload
        elif event.type == "message_delta":
            self._final = payload

    def to_json(self) -> str:
        final = self._final
        stop_reason = "null" if final is None else f'"{final.stop_reason}"'
        stop_sequence = (
            "null" if final is None or final.stop_sequence is None else _quote(final.stop_sequence)
        )
        usage = self._usage if final is None else final.usage
        return (
            f'{{"id":{_quote(self._id)},"type":"message","role":"assistant",'
            f'"model":{_quote(self._model)},"content":[{",".join(b.to_json(*entry) for b, *entry in self._blocks)}],'
            f'"stop_reason":{stop_reason},"stop_sequence":{stop_sequence},"usage":{usage}}}'
        )
