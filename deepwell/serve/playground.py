"""What the playground's endpoints compute: a request's rendered prompt cut into segments with
their token ids (`POST /v1/render`), and model output replayed through each dialect's stream.

The static page that calls them lives in `static/playground/`; `api.py` serves both.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from deepwell.recipe import (
    ConversationRequest,
    DeepseekV4Encoding,
    DeepseekV41Encoding,
    InferenceChunk,
    InferenceFinishReason,
    ModelVersion,
    ParsingOptions,
    RenderedPrompt,
    StreamProcessor,
)
from deepwell.recipe.dialects.detect import DIALECTS, detect_dialect
from deepwell.serve.errors import ApiError
from deepwell.serve.frontend import CHAT, MESSAGES, RESPONSES, Frontend, Route, template_kwargs
from deepwell.serve.model import PromptEncoding

STATIC_DIR = Path(__file__).parent / "static" / "playground"
ROUTES: dict[str, Route] = {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES}
# Without a tokenizer (`--mock`) pasted output streams word by word, spaces leading.
_WORD = re.compile(r"\s*\S+|\s+")


@dataclass(frozen=True)
class PromptSegment:
    """A maximal run of plain text, or one control token, of a rendered prompt.

    `token_ids` are the ids the server sends the engine for this segment (a control token
    is one fixed id; plain text is tokenized without the added vocabulary, so a typed
    control spelling stays text); `tokens` spell each id. Both are None without a tokenizer.
    """

    start: int
    end: int
    text: str
    special: bool
    token_ids: list[int] | None
    tokens: list[str] | None


@dataclass(frozen=True)
class RenderedRequest:
    """The answer of `POST /v1/render`."""

    dialect: str
    model: str
    encoding: str
    prompt: str
    special_ranges: list[tuple[int, int]]
    segments: list[PromptSegment]
    # The prompt ids of a generation request with this body; None under `--mock`.
    token_ids: list[int] | None


@dataclass(frozen=True)
class ReplayFrame:
    """One server-sent event a route would send, and the output piece that released it
    (None for the events that close the stream)."""

    piece: int | None
    event: str | None
    data: str


@dataclass(frozen=True)
class DialectReplay:
    dialect: str
    frames: list[ReplayFrame]
    # The accumulated response object (`stream: false`'s body).
    response: dict


@dataclass(frozen=True)
class Replay:
    """The answer of `POST /v1/replay`: the output as it was cut into stream pieces, and
    what each dialect's route makes of them."""

    pieces: list[str]
    dialects: list[DialectReplay]


def dialect_of(body: bytes | str, requested: str | None) -> str:
    """The dialect a body is read in: the one asked for, else guessed from its shape."""
    if requested is not None:
        if requested not in DIALECTS:
            raise ApiError(400, f"dialect must be one of {', '.join(DIALECTS)}, got {requested!r}")
        return requested
    try:
        return detect_dialect(json.loads(body))
    except ValueError:
        return "chat"  # the request class reports the syntax error


def render(frontend: Frontend, dialect: str, body: bytes | str) -> RenderedRequest:
    """Convert a body as its route would and render the prompt the served model would get."""
    model_name, converted, _ = frontend.convert(ROUTES[dialect], body)
    model = frontend.model
    encoding = model.encoding or _deepseek_encoding(converted)
    conversation = converted.conversation
    # A chat-template model renders with the request's `chat_template_kwargs`, as served.
    kwargs = template_kwargs(body.encode() if isinstance(body, str) else body, model)
    if kwargs:
        rendered = encoding.render_conversation(conversation, kwargs)
    else:
        rendered = encoding.render_conversation(conversation)
    return RenderedRequest(
        dialect=dialect,
        model=model_name,
        encoding=type(encoding).__name__,
        prompt=rendered.prompt,
        special_ranges=rendered.special_ranges,
        segments=_segments(frontend, rendered),
        token_ids=model.encode(conversation, kwargs) if model.tokenizer is not None else None,
    )


def _deepseek_encoding(converted: ConversationRequest) -> PromptEncoding:
    """The encoding of a request's model version, for a server with no model (`--mock`)."""
    if converted.model_version is ModelVersion.DeepseekV41Flash:
        return DeepseekV41Encoding()
    return DeepseekV4Encoding()


def _segments(frontend: Frontend, rendered: RenderedPrompt) -> list[PromptSegment]:
    """Plain runs between control tokens and the tokens themselves, tokenized the way the
    encodings encode a prompt (spec/recipe.md §5)."""
    prompt = rendered.prompt
    spans: list[tuple[int, int, bool]] = []
    at = 0
    for start, end in rendered.special_ranges:
        if start > at:
            spans.append((at, start, False))
        spans.append((start, end, True))
        at = end
    if at < len(prompt):
        spans.append((at, len(prompt), False))
    tokenizer = frontend.model.tokenizer
    if tokenizer is None:
        return [PromptSegment(s, e, prompt[s:e], special, None, None) for s, e, special in spans]
    plain = iter(tokenizer.encode_plain([prompt[s:e] for s, e, special in spans if not special]))
    segments = []
    for start, end, special in spans:
        text = prompt[start:end]
        if special:
            token_id = tokenizer.special_token_id(text)
            if token_id is None:
                raise ApiError(400, f'special token "{text}" is not in the model\'s vocabulary')
            ids = [token_id]
        else:
            ids = next(plain)
        spelled = [tokenizer.token_bytes(i).decode("utf-8", "replace") for i in ids]
        segments.append(PromptSegment(start, end, text, special, ids, spelled))
    return segments


def replay(frontend: Frontend, dialect: str, body: bytes | str, output: str) -> Replay:
    """Feed `output` (raw model text, control tokens spelled out) through the stream parser
    with the request's parsing options, once per dialect's chunk generator.

    With a tokenizer the output streams token by token, as the engine would send it;
    without one (`--mock`), word by word.
    """
    model_name, converted, parsing_options = frontend.convert(ROUTES[dialect], body)
    tokenizer = frontend.model.tokenizer
    if tokenizer is not None:
        ids = tokenizer.encode(output)
        pieces = [tokenizer.token_bytes(i).decode("utf-8", "replace") for i in ids]
        chunks = [InferenceChunk.tokens([i]) for i in ids]
    else:
        pieces = _WORD.findall(output)
        chunks = [InferenceChunk.text(piece, 1) for piece in pieces]
    dialects = [
        _replay_one(name, route, converted, parsing_options, model_name, frontend, chunks)
        for name, route in ROUTES.items()
    ]
    return Replay(pieces, dialects)


def _replay_one(
    name: str,
    route: Route,
    converted: ConversationRequest,
    parsing_options: ParsingOptions,
    model_name: str,
    frontend: Frontend,
    chunks: list[InferenceChunk],
) -> DialectReplay:
    request_id = str(uuid.uuid4())
    generator = route.request_type.chunk_generator(converted, request_id, model_name)
    processor = StreamProcessor(generator, parsing_options.copy(), frontend.model.tokenizer)
    response_type = route.response_type
    response = response_type(request_id, model_name, int(time.time()), 0, 0)
    frames: list[ReplayFrame] = []

    def take(events: list, piece: int | None) -> None:
        for event in events:
            # `accumulate` consumes the event: serialise it first.
            frames.append(ReplayFrame(piece, response_type.sse_event_name(event), event.to_json()))
            response.accumulate(event)

    take(processor.push(InferenceChunk.ready()), None)
    for index, chunk in enumerate(chunks):
        take(processor.push(chunk), index)
        if processor.finished:
            break
    if not processor.finished:
        take(processor.push(InferenceChunk.finish(InferenceFinishReason.Stop)), None)
    take(processor.finish(), None)
    done = response_type.sse_done_data()
    if done is not None:
        frames.append(ReplayFrame(None, None, done))
    return DialectReplay(name, frames, json.loads(response.to_json()))
