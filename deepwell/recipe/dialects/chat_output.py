"""Chat Completions output: streamed `chat.completion.chunk` objects and the complete response.

Shapes and field order follow spec/recipe.md §9.1; JSON is written by hand for speed.
"""

from __future__ import annotations

import time
from json.encoder import encode_basestring as _quote

from deepwell.recipe.options import ThinkingInitialStage
from deepwell.recipe.stream.chunks import CompletionUsage, LogprobEntry, PromptUsage

_START = 0
_CONTENT = 1
_REASONING = 2
_CALL = 3
_ARGUMENTS = 4
_FINAL = 5


def logprob_json(entry: LogprobEntry, with_top: bool) -> str:
    """One OpenAI logprob object: token, logprob, bytes[, top_logprobs]."""
    head = (
        '{"token":'
        + _quote(entry.token)
        + ',"logprob":'
        + entry.logprob
        + ',"bytes":['
        + ",".join(map(str, entry.token_bytes))
        + "]"
    )
    if not with_top:
        return head + "}"
    return head + ',"top_logprobs":[' + ",".join(logprob_json(t, False) for t in entry.top) + "]}"


def logprobs_json(entries: list[LogprobEntry]) -> str:
    return "[" + ",".join(logprob_json(e, True) for e in entries) + "]"


def chat_usage_json(usage: CompletionUsage) -> str:
    prompt = usage.prompt_tokens
    hit = usage.cached_tokens
    completion = usage.completion_tokens
    details = (
        f',"completion_tokens_details":{{"reasoning_tokens":{usage.reasoning_tokens}}}'
        if usage.reasoning_tokens is not None
        else ""
    )
    return (
        f'{{"prompt_tokens":{prompt},"completion_tokens":{completion},'
        f'"total_tokens":{prompt + completion},"prompt_tokens_details":{{"cached_tokens":{hit}}}'
        f'{details},"prompt_cache_hit_tokens":{hit},"prompt_cache_miss_tokens":{max(0, prompt - hit)}}}'
    )


class ChatCompletionChunk:
    """One streamed chunk; `to_json()` renders it, `ChatCompletionResponse.accumulate` consumes it."""

    __slots__ = (
        "_generator",
        "_kind",
        "_created",
        "_text",
        "_index",
        "_call_id",
        "_logprobs",
        "_finish_reason",
        "_usage",
        "_consumed",
    )

    def __init__(
        self,
        generator: ChatCompletionChunkGenerator,
        kind: int,
        text: str = "",
        index: int = 0,
        call_id: str = "",
        logprobs: list[LogprobEntry] | None = None,
        finish_reason: str | None = None,
        usage: CompletionUsage | None = None,
    ) -> None:
        self._generator = generator
        self._kind = kind
        self._created = int(time.time())
        self._text = text
        self._index = index
        self._call_id = call_id
        self._logprobs = logprobs
        self._finish_reason = finish_reason
        self._usage = usage
        self._consumed = False

    def to_json(self) -> str:
        if self._consumed:
            raise RuntimeError("protocol chunk has been consumed")
        generator = self._generator
        kind = self._kind
        if kind == _CONTENT:
            delta = '{"content":' + _quote(self._text) + generator.content_tail
        elif kind == _REASONING:
            delta = '{"content":null,"reasoning_content":' + _quote(self._text) + "}"
        elif kind == _ARGUMENTS:
            delta = (
                f'{{"tool_calls":[{{"index":{self._index},"function":{{"arguments":'
                + _quote(self._text)
                + "}}]}"
            )
        elif kind == _CALL:
            delta = (
                f'{{"tool_calls":[{{"index":{self._index},"id":'
                + _quote(self._call_id)
                + ',"type":"function","function":{"name":'
                + _quote(self._text)
                + ',"arguments":""}}]}'
            )
        elif kind == _START:
            delta = generator.start_delta
        else:
            delta = '{"content":""' + generator.content_tail
        logprobs = "null"
        if self._logprobs is not None:
            field = "reasoning_content" if kind == _REASONING else "content"
            logprobs = '{"' + field + '":' + logprobs_json(self._logprobs) + "}"
        finish = "null" if self._finish_reason is None else '"' + self._finish_reason + '"'
        usage = (
            generator.no_usage
            if self._usage is None
            else ',"usage":' + chat_usage_json(self._usage) + "}"
        )
        return (
            f"{generator.head}{self._created}{generator.middle}{delta}"
            f',"logprobs":{logprobs},"finish_reason":{finish}}}]{usage}'
        )


class ChatCompletionChunkGenerator:
    """Turns parser output into Chat Completions chunks (obtain via `ChatCompletionRequest`)."""

    __slots__ = (
        "id",
        "model",
        "head",
        "middle",
        "start_delta",
        "content_tail",
        "fingerprint",
        "no_usage",
        "thinking_mode",
    )

    def __init__(
        self,
        id: str,
        model: str,
        thinking_initial_stage: ThinkingInitialStage | None,
        null_usage: bool = True,
        thinking_mode: bool | None = None,
    ) -> None:
        self.id = id
        self.model = model
        # How a chunk without usage ends: `"usage":null`, or no usage key at all.
        self.no_usage = ',"usage":null}' if null_usage else "}"
        self.head = '{"id":' + _quote(id) + ',"object":"chat.completion.chunk","created":'
        self.middle = ""
        self.fingerprint = None
        # The delta shapes follow the request (its conversation's thinking mode and the stage
        # its own parsing options start in), not the parsing options a processor may be
        # given (spec/recipe.md §9.1). A request built directly keeps the stage None while
        # its conversation thinks: its deltas carry a null reasoning_content from the start.
        stage = thinking_initial_stage
        self.thinking_mode = stage is not None if thinking_mode is None else thinking_mode
        if not self.thinking_mode:
            self.start_delta = '{"role":"assistant","content":""}'
        elif stage is not None and stage.starts_in_reasoning():
            self.start_delta = '{"role":"assistant","content":null,"reasoning_content":""}'
        else:
            self.start_delta = '{"role":"assistant","content":"","reasoning_content":null}'
        self.content_tail = ',"reasoning_content":null}' if self.thinking_mode else "}"

    def start(self, prompt_usage: PromptUsage, system_fingerprint: str | None, out: list) -> None:
        self.fingerprint = system_fingerprint
        fingerprint = "null" if system_fingerprint is None else _quote(system_fingerprint)
        self.middle = (
            ',"model":'
            + _quote(self.model)
            + ',"system_fingerprint":'
            + fingerprint
            + ',"choices":[{"index":0,"delta":'
        )
        out.append(ChatCompletionChunk(self, _START))

    def reasoning(self, text: str, logprobs: list[LogprobEntry] | None, out: list) -> None:
        out.append(ChatCompletionChunk(self, _REASONING, text, logprobs=logprobs))

    def content(self, text: str, logprobs: list[LogprobEntry] | None, out: list) -> None:
        out.append(ChatCompletionChunk(self, _CONTENT, text, logprobs=logprobs))

    def tool_call(self, index: int, call_id: str, name: str, out: list) -> None:
        out.append(ChatCompletionChunk(self, _CALL, name, index, call_id))

    def arguments(self, index: int, piece: str, is_string_value: bool, out: list) -> None:
        if is_string_value:
            piece = _quote(piece)[1:-1]
        out.append(ChatCompletionChunk(self, _ARGUMENTS, piece, index))

    def finish(
        self, reason: str, stop_sequence: str | None, usage: CompletionUsage, out: list
    ) -> None:
        if not self.thinking_mode and usage.reasoning_tokens is not None:
            # A request outside thinking mode reports no reasoning tokens, even where the
            # parsing options it was given counted some.
            usage = CompletionUsage(
                usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, None
            )
        out.append(ChatCompletionChunk(self, _FINAL, finish_reason=reason, usage=usage))


class ChatCompletionResponse:
    """The non-streaming `chat.completion` object, built by accumulating the stream's chunks."""

    def __init__(
        self, id: str, model: str, created: int, prompt_tokens: int, prompt_cache_hit_tokens: int
    ) -> None:
        self._id = id
        self._model = model
        self._created = created
        # Deltas merge like JSON: a null start field stays null until text arrives.
        self._started = False
        self._content: list[str] | None = None
        self._reasoning: list[str] | None = None
        self._calls: list[list] = []
        self._logprobs: list[LogprobEntry] | None = None
        self._reasoning_logprobs: list[LogprobEntry] | None = None
        self._finish_reason: str | None = None
        self._usage: CompletionUsage | None = None
        self._fingerprint: str | None = None

    @staticmethod
    def sse_event_name(chunk: ChatCompletionChunk) -> str | None:
        return None

    @staticmethod
    def sse_done_data() -> str | None:
        return "[DONE]"

    def accumulate(self, chunk: ChatCompletionChunk) -> None:
        if chunk._consumed:
            raise RuntimeError("protocol chunk has been consumed")
        chunk._consumed = True
        kind = chunk._kind
        self._fingerprint = chunk._generator.fingerprint
        if kind in (_CONTENT, _FINAL):
            if self._content is None:
                self._content = []
            self._content.append(chunk._text)
        elif kind == _REASONING:
            if self._reasoning is None:
                self._reasoning = []
            self._reasoning.append(chunk._text)
        elif kind == _ARGUMENTS:
            self._calls[chunk._index][3].append(chunk._text)
        elif kind == _CALL:
            self._calls.append([chunk._index, chunk._call_id, chunk._text, []])
        elif kind == _START:
            self._started = True
            start = chunk._generator.start_delta
            # The reasoning field exists iff the start delta carried text (spec/recipe.md §9.1).
            if '"reasoning_content":""' in start:
                self._reasoning = []
            if '"content":""' in start:
                self._content = []
        if kind == _FINAL:
            self._finish_reason = chunk._finish_reason
            self._usage = chunk._usage
        if chunk._logprobs is not None:
            if kind == _REASONING:
                self._reasoning_logprobs = (self._reasoning_logprobs or []) + chunk._logprobs
            else:
                self._logprobs = (self._logprobs or []) + chunk._logprobs

    def to_json(self) -> str:
        head = (
            f'{{"id":{_quote(self._id)},"object":"chat.completion","created":{self._created},'
            f'"model":{_quote(self._model)},"choices":['
        )
        fingerprint = "null" if self._fingerprint is None else _quote(self._fingerprint)
        if not self._started:
            return f'{head}],"system_fingerprint":{fingerprint}}}'
        content = "null" if self._content is None else _quote("".join(self._content))
        message = '{"role":"assistant","content":' + content
        if self._reasoning is not None:
            message += ',"reasoning_content":' + _quote("".join(self._reasoning))
        if self._calls:
            message += (
                ',"tool_calls":['
                + ",".join(
                    f'{{"index":{index},"id":{_quote(call_id)},"type":"function",'
                    f'"function":{{"name":{_quote(name)},"arguments":{_quote("".join(args))}}}}}'
                    for index, call_id, name, args in self._calls
                )
                + "]"
            )
        fields = []
        if self._logprobs is not None:
            fields.append('"content":' + logprobs_json(self._logprobs))
        if self._reasoning_logprobs is not None:
            fields.append('"reasoning_content":' + logprobs_json(self._reasoning_logprobs))
        logprobs = "{" + ",".join(fields) + "}" if fields else "null"
        finish = "null" if self._finish_reason is None else _quote(self._finish_reason)
        usage = "" if self._usage is None else f',"usage":{chat_usage_json(self._usage)}'
        return (
            f'{head}{{"index":0,"message":{message}}},"logprobs":{logprobs},'
            f'"finish_reason":{finish}}}]{usage},"system_fingerprint":{fingerprint}}}'
        )
