"""Glue between HTTP and inference: recipe conversion → inference request; chunks → dialect events.

`Infer` is the seam: the engine client, the mock and any custom source all turn an
`InferenceRequest` into `InferenceChunk`s, and closing the chunk stream aborts the request.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.multimodal import ImageInput
from deepwell.engine.outputs import FinishReason
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.structured.spec import StructuredOutput
from deepwell.recipe import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    Conversation,
    ConversationRequest,
    ConversionError,
    InferenceChunk,
    InferenceFinishReason,
    MessagesRequest,
    MessagesResponse,
    ModelVersion,
    ParsingOptions,
    PromptUsage,
    ResponsesRequest,
    ResponsesResponse,
    SpecialToken,
    StreamProcessor,
)
from deepwell.recipe.dialects.responses import SERVER_TOOLS
from deepwell.serve.cluster.request_router import RequestRouter
from deepwell.serve.errors import ApiError, ErrorShape
from deepwell.serve.images.intake import ImageIntake, conversation_images
from deepwell.serve.json_body import json_object
from deepwell.serve.messages import GenerateRequest
from deepwell.serve.metrics import RequestTimer
from deepwell.serve.model import ServedModel
from deepwell.serve.parallel_samples import (
    ChunkIndexer,
    interleaved,
    merged_response,
    requested_samples,
    samples_of,
)
from deepwell.serve.sampling_fields import SEED_LIMIT, read_sampling_params, requested_budget
from deepwell.serve.schema_coverage import unenforced_keywords
from deepwell.serve.token_ids import ChatTokenIds, wants_token_ids


@dataclass(frozen=True)
class InferenceRequest:
    """What an inference source gets: the converted request, its prompt ids and sampling.

    `prompt_token_ids` is empty when the served model has no tokenizer (`--mock`).
    """

    request_id: str
    converted: ConversationRequest
    prompt_token_ids: list[int]
    # Budget, seed (the body's, else the SEED_HEADER request header, else the server's
    # --seed, else random), stop ids (the model's included) and grammar, all checked.
    sampling: SamplingParams
    # Traffic class for the KV store TTL, from the CACHE_CLASS_HEADER request header.
    cache_class: str = "chat"
    # The prompt's images, each filling its span of `prompt_token_ids`.
    images: list[ImageInput] = field(default_factory=list)


Infer = Callable[[InferenceRequest], AsyncIterator[InferenceChunk]]

# Agent traffic (tool loops) re-reads its prefix soon or never; chat traffic comes back
# days later. The class picks how long the KV store keeps a request's blocks.
CACHE_CLASS_HEADER = "x-deepwell-cache-class"
CACHE_CLASSES = ("chat", "agent")
# Request header: the sampling seed for dialects without a `seed` field (Responses,
# Messages; Chat's `seed` wins). Response header: the seed the request sampled with, its
# own or a random one, so any sampled reply can be replayed.
SEED_HEADER = "x-deepwell-seed"
# Response header: the schema keywords the engine's grammar could not enforce (accepted, as
# the reference accepts them, but not promised), comma-separated; absent when none.
UNENFORCED_HEADER = "x-deepwell-unenforced-schema-keywords"


@dataclass(frozen=True)
class Route:
    """One generation endpoint: its recipe request and response types and its clients' shape."""

    path: str
    request_type: type
    response_type: type
    shape: ErrorShape
    # Which body the extra sampling fields are read from (sampling_fields.py).
    dialect: str


CHAT = Route(
    "/v1/chat/completions",
    ChatCompletionRequest,
    ChatCompletionResponse,
    ErrorShape.OPENAI,
    "chat",
)
RESPONSES = Route(
    "/v1/responses", ResponsesRequest, ResponsesResponse, ErrorShape.OPENAI, "responses"
)
MESSAGES = Route(
    "/v1/messages", MessagesRequest, MessagesResponse, ErrorShape.ANTHROPIC, "messages"
)


@dataclass
class PreparedRequest:
    """A converted, encoded, budgeted request, ready to run once."""

    route: Route
    model: str
    converted: ConversationRequest
    parsing_options: ParsingOptions
    generator: object
    inference: InferenceRequest
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_usage: PromptUsage | None = None
    # Keywords of the request's JSON schema the grammar skips (UNENFORCED_HEADER).
    unenforced_keywords: list[str] = field(default_factory=list)
    # Images the model answered without seeing (IMAGES_NOT_SEEN_HEADER).
    images_not_seen: int = 0
    # Chat's `return_token_ids`: adds the ids to the response; None when not asked.
    token_ids: ChatTokenIds | None = None
    # The ids generated so far (the text's tokens, as the chunks bring them).
    output_token_ids: list[int] = field(default_factory=list)
    # Chat's `n`: samples of the prompt answered as one response (parallel_samples.py).
    samples: int = 1

    def new_response(self) -> Any:
        """The response object this request's events accumulate into."""
        usage = self.prompt_usage or PromptUsage()
        return self.route.response_type(
            self.inference.request_id,
            self.model,
            self.created,
            usage.prompt_tokens,
            usage.prompt_cache_hit_tokens,
        )

    def sample_requests(self) -> list[PreparedRequest]:
        route, converted = self.route, self.converted

        def generator() -> object:
            return route.request_type.chunk_generator(
                converted, self.inference.request_id, self.model
            )

        # Each sample gathers its own output ids (the request's list would be shared).
        return [
            replace(sample, output_token_ids=[])
            for sample in samples_of(self, self.samples, generator)
        ]


def mock_infer(request: InferenceRequest) -> AsyncIterator[InferenceChunk]:
    """The reference example server's fixed reply (spec/recipe.md §11)."""

    async def chunks() -> AsyncIterator[InferenceChunk]:
        yield InferenceChunk.ready()
        stage = request.converted.parsing_options.thinking_initial_stage
        if stage is not None and stage.starts_in_reasoning():
            yield InferenceChunk.text("</think>")
        yield InferenceChunk.text("Hello ", 1)
        yield InferenceChunk.text("world!", 1)
        yield InferenceChunk.finish(InferenceFinishReason.Stop)

    return chunks()


def engine_infer(client: RequestRouter) -> Infer:
    """An inference source backed by engine workers: one `GenerateRequest` per request."""

    async def infer(request: InferenceRequest) -> AsyncIterator[InferenceChunk]:
        outputs = client.generate(
            GenerateRequest(
                request.request_id,
                request.prompt_token_ids,
                request.sampling,
                request.cache_class,
                request.images,
            )
        )
        try:
            ready = False
            async for output in outputs:
                if not ready:
                    usage = PromptUsage(
                        prompt_tokens=output.num_prompt_tokens,
                        prompt_cache_hit_tokens=output.num_cached_tokens,
                    )
                    yield InferenceChunk.ready(prompt_usage=usage)
                    ready = True
                # The engine's stop id is not text (spec/recipe.md §8.2): the parser would
                # show it, so the chunk carries the text tokens only.
                token_ids = output.text_token_ids
                if token_ids:
                    logprobs = [(lp.logprob, lp.top) for lp in output.text_logprobs]
                    yield InferenceChunk.tokens(token_ids, logprobs or None)
                if output.finish_reason is FinishReason.LENGTH:
                    yield InferenceChunk.finish(InferenceFinishReason.Length)
                elif output.finished:
                    yield InferenceChunk.finish(InferenceFinishReason.Stop)
        finally:
            await outputs.aclose()

    return infer


class Frontend:
    """Runs requests of the three dialects against one served model and inference source.

    `default_seed` (serve --seed) samples requests that bring no seed of their own;
    `images` checks, reads and preprocesses the requests' images for the model.
    """

    def __init__(
        self,
        model: ServedModel,
        infer: Infer,
        images: ImageIntake,
        default_seed: int | None = None,
    ) -> None:
        self.model = model
        self._infer = infer
        self.images = images
        self.default_seed = default_seed

    def prepare(
        self, route: Route, body: bytes, cache_class: str = "chat", seed_header: str | None = None
    ) -> PreparedRequest:
        """Parse, convert, encode and budget a request body; CPU work, run it off the loop.

        Raises `ApiError` for unreadable bodies and `ConversionError` for requests the
        recipe refuses (including prompt + max_tokens beyond the context, spec §7).
        """
        if cache_class not in CACHE_CLASSES:
            raise ApiError(
                400,
                f"The {CACHE_CLASS_HEADER} header must be one of {', '.join(CACHE_CLASSES)}, "
                f"got {cache_class!r}.",
            )
        header_seed = _parse_seed_header(seed_header)
        samples, body = requested_samples(body) if route is CHAT else (1, body)
        if samples > 1 and b"return_token_ids" in body and wants_token_ids(json.loads(body)):
            raise ApiError(400, "return_token_ids is not supported with n > 1", param="n")
        model_name, converted, parsing_options = self.convert(route, body)
        # The recipe ignores the fields the reference ignores: the extras are read beside it.
        data = json.loads(body)
        conversation = converted.conversation
        kwargs = template_kwargs(body, self.model)
        prompt_token_ids, images = self.encode(model_name, conversation, kwargs)
        max_tokens = converted.resolve_max_tokens(len(prompt_token_ids), self.model.context_limit)
        requested = requested_budget(route.dialect, data)
        if requested is not None:
            max_tokens = self._completion_budget(
                requested, len(prompt_token_ids), conversation.thinking_mode
            )
        request_id = str(uuid.uuid4())
        generator = route.request_type.chunk_generator(converted, request_id, model_name)
        structured = None
        unenforced: list[str] = []
        if self.model.tokenizer is not None:
            structured = structured_output_spec(converted, parsing_options, self.model)
            if structured is not None and structured.kind == "json_schema":
                unenforced = unenforced_keywords(structured.spec)
        sampling = read_sampling_params(
            route.dialect,
            data,
            converted.inference_options,
            max_tokens=max_tokens,
            fallback_seed=self.request_seed(header_seed),
            model_stop_token_ids=self.model.stop_token_ids,
            structured_output=structured,
        )
        inference = InferenceRequest(
            request_id, converted, prompt_token_ids, sampling, cache_class, images
        )
        return PreparedRequest(
            route,
            model_name,
            converted,
            parsing_options,
            generator,
            inference,
            unenforced_keywords=unenforced,
            images_not_seen=self._images_not_seen(route, body, converted),
            token_ids=ChatTokenIds(prompt_token_ids)
            if route is CHAT and wants_token_ids(data)
            else None,
            samples=samples,
        )

    def encode(
        self, model_name: str, conversation: Conversation, variables: dict | None = None
    ) -> tuple[list[int], list[ImageInput]]:
        """The prompt ids, each image placeholder expanded into its span, and the images;
        `variables` are a template model's `chat_template_kwargs`.

        Images the model cannot take, too many, or unreadable ones are refused here
        (`ApiError` 400 naming the image's part of the request).
        """
        sources = conversation_images(conversation)
        self.images.admit(model_name, sources)
        if not sources:
            return self.model.encode(conversation, variables), []
        prepared = self.images.prepare(sources)
        encoding = self.model.encoding
        if encoding is None or self.model.tokenizer is None:
            # --mock: the images were checked and preprocessed; there is no prompt to fill.
            return [], []
        prompt_ids, rendered = encoding.encode_with_images(conversation)
        # A rendering may drop a message and its images (an empty system message).
        by_source = {id(source): image for source, image in zip(sources, prepared, strict=True)}
        spelling = self.model.conversion_options.special_tokens.token(SpecialToken.Image)
        placeholder_id = self.model.tokenizer.special_token_id(spelling)
        if placeholder_id is None:
            raise ApiError(400, f"the model's tokenizer has no {spelling} to place images with")
        return self.images.prompt_images(
            prompt_ids, placeholder_id, [by_source[id(source)] for source in rendered]
        )

    def _images_not_seen(self, route: Route, body: bytes, converted: ConversationRequest) -> int:
        """Images V4-Pro's conversion replaced by its stand-in text: the request converted
        again keeping them (at least one when that conversion refuses one of them)."""
        options = self.model.conversion_options
        if (
            converted.model_version is not ModelVersion.DeepseekV4Pro
            or options.images_supported is not None
            or b"image" not in body
        ):
            return 0
        try:
            kept = read_request(route.request_type, body).convert(
                options.with_images_supported(True)
            )
        except (ConversionError, ApiError):
            return 1
        return len(conversation_images(kept.conversation))

    def request_seed(self, *given: int | None) -> int:
        """The first seed the request gave (body, then header), else the server's, else random."""
        for seed in (*given, self.default_seed):
            if seed is not None:
                return seed
        return secrets.randbelow(SEED_LIMIT)

    def _completion_budget(self, requested: int, prompt_tokens: int, thinking: bool) -> int:
        """Chat's `max_completion_tokens`, checked as the recipe checks `max_tokens`."""
        options = self.model.conversion_options
        bound = (
            options.thinking_max_tokens_upper_bound
            if thinking
            else options.non_thinking_max_tokens_upper_bound
        )
        if requested > bound:
            raise ApiError(
                400,
                f"Invalid 'max_completion_tokens': the valid range is [1, {bound}].",
                param="max_completion_tokens",
            )
        limit = self.model.context_limit
        if prompt_tokens + requested > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages or "
                "max_completion_tokens.",
                param="max_completion_tokens",
            )
        return requested

    def convert(
        self, route: Route, body: bytes | str | dict
    ) -> tuple[str, ConversationRequest, ParsingOptions]:
        """Parse and convert a body for the served model: its model name, the converted
        request and the parsing options to read the output with.

        Raises `ApiError` for unreadable bodies and what the model cannot do, and
        `ConversionError` for requests the recipe refuses.
        """
        request = read_request(route.request_type, body)
        if route is RESPONSES:
            refuse_builtin_tools(body)
        model_name = request.model
        try:
            converted = request.convert(self.model.conversion_options)
        except ConversionError as error:
            raise _with_thinking_hint(error, route.dialect) from None
        conversation = converted.conversation
        parsing_options = converted.parsing_options
        if not self.model.supports_tools:
            if _declares_tools(conversation):
                raise ApiError(400, f"The model {model_name} does not support tools.")
            parsing_options.parse_tool_calls = False
        if not self.model.supports_thinking and conversation.thinking_mode:
            raise ApiError(400, f"The model {model_name} does not support thinking.")
        parsing_options.tool_call_format = self.model.tool_call_format
        return model_name, converted, parsing_options

    def count_tokens(self, body: bytes) -> int:
        """Prompt tokens of a Messages request body (`/v1/messages/count_tokens`): the prompt
        a `/v1/messages` request with the same body reads, system, tools and images included,
        and refused where that request would be (tools to a model without them)."""
        data = json_object(body)
        # Counting needs no output budget, but the Messages schema requires one.
        data.setdefault("max_tokens", 1)
        model_name, converted, _ = self.convert(MESSAGES, data)
        variables = template_kwargs(body, self.model)
        return len(self.encode(model_name, converted.conversation, variables)[0])

    async def events(self, prepared: PreparedRequest, timer: RequestTimer) -> AsyncIterator:
        """The dialect events of one request, ending with the final ones; closing aborts it."""
        processor = StreamProcessor(
            prepared.generator, prepared.parsing_options, self.model.tokenizer
        )
        chunks = self._infer(prepared.inference)
        try:
            async for chunk in chunks:
                kind = chunk.kind
                if kind == "ready" and prepared.prompt_usage is None:
                    usage = chunk.prompt_usage or PromptUsage(
                        prompt_tokens=len(prepared.inference.prompt_token_ids)
                    )
                    prepared.prompt_usage = usage
                    timer.prompt(usage.prompt_tokens, usage.prompt_cache_hit_tokens)
                elif kind == "tokens":
                    timer.output(len(chunk.token_ids))
                    prepared.output_token_ids.extend(chunk.token_ids)
                elif kind == "text":
                    timer.output(chunk.token_count or 0)
                for event in processor.push(chunk):
                    yield event
                if processor.finished:
                    break
            for event in processor.finish():
                yield event
        finally:
            await chunks.aclose()

    async def complete(self, prepared: PreparedRequest, timer: RequestTimer) -> str:
        """Run a request to its end and return the accumulated response JSON."""
        if prepared.samples > 1:
            return await self._complete_samples(prepared, timer)
        response = None
        events = self.events(prepared, timer)
        try:
            async for event in events:
                if response is None:
                    response = prepared.new_response()
                response.accumulate(event)
        finally:
            await events.aclose()
        # The processor's final events always come, so a response object exists here.
        if prepared.token_ids is not None:
            return prepared.token_ids.response(response.to_json(), prepared.output_token_ids)
        return response.to_json()

    async def sse(self, prepared: PreparedRequest, timer: RequestTimer) -> AsyncIterator[bytes]:
        """Server-sent-event frames of a streamed request, with the dialect's terminal frame."""
        response_type = prepared.route.response_type
        if prepared.samples > 1:
            indexer = ChunkIndexer(prepared.samples)
            sample_events = self._sample_events(prepared, timer)
            try:
                async for index, event in sample_events:
                    yield sse_frame(None, indexer.chunk(index, event.to_json()))
            finally:
                await sample_events.aclose()
        else:
            events = self.events(prepared, timer)
            try:
                async for event in events:
                    data = event.to_json()
                    if prepared.token_ids is not None:
                        data = prepared.token_ids.chunk(data, prepared.output_token_ids)
                    yield sse_frame(response_type.sse_event_name(event), data)
            finally:
                await events.aclose()
        done = response_type.sse_done_data()
        if done is not None:
            yield sse_frame(None, done)

    async def _complete_samples(self, prepared: PreparedRequest, timer: RequestTimer) -> str:
        responses: dict[int, Any] = {}
        events = self._sample_events(prepared, timer)
        try:
            async for index, event in events:
                if index not in responses:
                    responses[index] = prepared.new_response()
                responses[index].accumulate(event)
        finally:
            await events.aclose()
        return merged_response([responses[index].to_json() for index in sorted(responses)])

    def _sample_events(
        self, prepared: PreparedRequest, timer: RequestTimer
    ) -> AsyncIterator[tuple[int, Any]]:
        """(sample index, event) of a request's samples, as they come; the request's prompt
        usage is its first sample's, which read the prompt."""
        samples = prepared.sample_requests()

        def stream(sample: PreparedRequest) -> Callable[[], AsyncIterator]:
            async def events() -> AsyncIterator:
                async for event in self.events(sample, timer):
                    if prepared.prompt_usage is None:
                        prepared.prompt_usage = samples[0].prompt_usage
                    yield event

            return events

        return interleaved([stream(sample) for sample in samples])


# What the recipe's request classes raise for a body they cannot read: bad JSON or a field
# of the wrong type (ValueError), nesting too deep (RecursionError), an integer outside the
# JSON range (OverflowError); spec/recipe.md §1.
_UNREADABLE_BODY = (ValueError, RecursionError, OverflowError)


# The recipe's refusal of a forced tool call in thinking mode (DeepSeek's own text), and how
# each dialect turns thinking off, which the text does not say.
_THINKING_TOOL_CHOICE = "Thinking mode does not support this tool_choice"
_THINKING_OFF = {
    "chat": '"thinking": {"type": "disabled"} (or "reasoning_effort": "none")',
    "responses": '"reasoning": {"effort": "none"}',
    "messages": '"thinking": {"type": "disabled"}',
}


def _with_thinking_hint(error: ConversionError, dialect: str) -> ConversionError:
    if error.message != _THINKING_TOOL_CHOICE:
        return error
    return ConversionError(
        f"{error.message}: a required or named tool_choice needs thinking off; send "
        f"{_THINKING_OFF[dialect]}, or use tool_choice auto.",
        error.status_code,
    )


def refuse_builtin_tools(body: bytes | str | dict) -> None:
    """A Responses request that declares one of OpenAI's built-in tools gets a 400 naming it.

    The recipe drops them, as DeepSeek's API does; a server that silently runs without the
    search the client asked for answers from what the model remembers instead. A body that
    declares no tools is not parsed again.
    """
    if isinstance(body, bytes | str):
        if (b'"tools"' if isinstance(body, bytes) else '"tools"') not in body:
            return
        body = json.loads(body)
    # The positional (array) form of a body carries only the reference's fields.
    tools = body.get("tools") if isinstance(body, dict) else None
    for index, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in SERVER_TOOLS:
            raise ApiError(
                400,
                f"The built-in tool '{kind}' (tools[{index}]) is not run by this server; "
                "declare a function tool and run it on your side.",
                param=f"tools[{index}]",
            )


def read_request(request_type: type, body: bytes | str | dict):
    """A recipe request read from `body`; raises `ApiError` 400 naming what is unreadable."""
    try:
        return request_type(body)
    except _UNREADABLE_BODY as error:
        raise ApiError(400, str(error)) from None


def sse_frame(event: str | None, data: str) -> bytes:
    """One server-sent event: an optional `event:` line, one `data:` line, a blank line."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {data}\n\n".encode()


def structured_output_spec(
    converted: ConversationRequest, parsing_options: ParsingOptions, model: ServedModel
) -> StructuredOutput | None:
    """The engine constraint for a request's output constraint, if it has one.

    A forced tool call (`tool_call_required`) must match the model's tool-call grammar;
    with tool_choice auto the stream parser reads calls from free text. In thinking mode the
    grammar starts after the end-of-thinking token, so reasoning stays free and the answer
    matches (spec/deepinfer.md §1.5, trigger tokens).

    A JSON schema is the one the user wrote (`ConversationRequest.output_schema`), so
    keywords the reference's strict normalisation drops (minItems, maxLength, $defs, …) are
    enforced too; the output constraint's normalised text is the fallback.
    """
    constraint = converted.inference_options.output_constraint
    if constraint is None:
        return None
    if constraint.kind == "tool_call_required" and model.tool_call_grammar is not None:
        kind, spec = "ebnf", model.tool_call_grammar(converted.conversation.tools)
    elif constraint.kind == "regex":
        kind, spec = "regex", constraint.schema
    elif constraint.kind == "json" and not constraint.schema:
        kind, spec = "json_object", ""
    elif constraint.kind == "json":
        schema = converted.output_schema
        spec = constraint.schema if schema is None else json.dumps(schema, separators=(",", ":"))
        kind = "json_schema"
    else:
        return None
    trigger: tuple[int, ...] = ()
    stage = parsing_options.thinking_initial_stage
    if stage is not None and stage.starts_in_reasoning():
        spelling = parsing_options.special_tokens.token(SpecialToken.ThinkingEnd)
        end = model.tokenizer.special_token_id(spelling)
        if end is None:
            raise ApiError(400, f"structured output in thinking mode needs a {spelling} token")
        trigger = (end,)
    try:
        return StructuredOutput(kind, spec, trigger)
    except InvalidRequestError as error:
        raise ApiError(400, str(error)) from None


def template_kwargs(body: bytes, model: ServedModel) -> dict | None:
    """The request's `chat_template_kwargs` (vLLM's extension): extra template variables.

    The recipe ignores unknown fields, so the body is read again for this one, when it
    can be there.
    """
    if b"chat_template_kwargs" not in body:
        return None
    data = json.loads(body)
    value = data.get("chat_template_kwargs") if isinstance(data, dict) else None
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, "chat_template_kwargs must be an object.")
    if not model.takes_template_kwargs:
        raise ApiError(
            400, "chat_template_kwargs apply only to models served with a chat template."
        )
    return value


def _declares_tools(conversation) -> bool:
    if conversation.tools:
        return True
    return any(getattr(message, "tools", None) for message in conversation.messages)


def _parse_seed_header(value: str | None) -> int | None:
    if value is None:
        return None
    if not value.isdigit() or int(value) >= SEED_LIMIT:
        raise ApiError(
            400, f"The {SEED_HEADER} header must be an integer in [0, 2^63), got {value!r}."
        )
    return int(value)
