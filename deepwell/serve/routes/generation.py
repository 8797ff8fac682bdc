"""The chat routes of the three dialects: Chat Completions, Responses and Messages, and
Messages' token counter."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from deepwell.recipe import ChatCompletionRequest, MessagesRequest, ResponsesRequest
from deepwell.serve.cluster.inference_errors import InferenceError
from deepwell.serve.errors import ApiError, ErrorShape, error_response
from deepwell.serve.frontend import (
    CACHE_CLASS_HEADER,
    CHAT,
    MESSAGES,
    RESPONSES,
    SEED_HEADER,
    UNENFORCED_HEADER,
    Frontend,
    PreparedRequest,
    Route,
)
from deepwell.serve.gateway import Gateway
from deepwell.serve.images.intake import IMAGES_NOT_SEEN_HEADER
from deepwell.serve.metrics import RequestTimer, ServeMetrics
from deepwell.serve.openapi import answers, json_body
from deepwell.serve.request_log import note, prompt_of
from deepwell.serve.routes.access import (
    Admitted,
    AnthropicAdmitted,
    AnthropicKey,
    Body,
    OpenAIAdmitted,
)
from deepwell.serve.routes.delivery import Delivery, complete, event_stream
from deepwell.serve.routes.dialect_route import dialect_route
from deepwell.serve.routes.parts import (
    FrontendDep,
    GatewayDep,
    MetricsDep,
    ResponsesDep,
    SettingsDep,
)
from deepwell.serve.stored_responses import (
    ResponsesState,
    ResponsesTurn,
    TurnRecorder,
    event_response,
    read_turn,
)

openai_router = APIRouter(route_class=dialect_route(ErrorShape.OPENAI))
anthropic_router = APIRouter(route_class=dialect_route(ErrorShape.ANTHROPIC))


@dataclass(frozen=True)
class _Generator:
    """What a generation route answers with: the frontend, and the meters and the gateway
    that record and bill the request."""

    frontend: Frontend
    metrics: ServeMetrics
    gateway: Gateway
    # serve --log-prompts: the request log line carries the prompt.
    log_prompts: bool


def _generator(
    frontend: FrontendDep, metrics: MetricsDep, gateway: GatewayDep, settings: SettingsDep
) -> _Generator:
    return _Generator(frontend, metrics, gateway, settings.log_prompts)


GeneratorDep = Annotated[_Generator, Depends(_generator)]


@openai_router.post(
    CHAT.path,
    openapi_extra=json_body(ChatCompletionRequest.json_schema(), summary="Chat Completions"),
    responses=answers(ErrorShape.OPENAI, streams=True),
)
async def chat_completions(
    request: Request, admitted: OpenAIAdmitted, generator: GeneratorDep
) -> Response:
    return await _generate(CHAT, request, admitted, generator)


@openai_router.post(
    RESPONSES.path,
    openapi_extra=json_body(
        ResponsesRequest.json_schema(),
        summary="Responses (store, previous_response_id, background)",
    ),
    responses=answers(ErrorShape.OPENAI, streams=True),
)
async def responses(
    request: Request, admitted: OpenAIAdmitted, generator: GeneratorDep, state: ResponsesDep
) -> Response:
    """A Responses turn: continued from a stored one, stored, or run in the background
    when the body asks (stored_responses.py)."""
    try:
        turn = read_turn(admitted.body, state.store)
    except BaseException:
        admitted.leave()
        raise
    admitted.body = turn.body
    if not turn.stateful:
        return await _generate(RESPONSES, request, admitted, generator)
    return await _generate(RESPONSES, request, admitted, generator, (turn, state))


@anthropic_router.post(
    MESSAGES.path,
    openapi_extra=json_body(MessagesRequest.json_schema(), summary="Anthropic Messages"),
    responses=answers(ErrorShape.ANTHROPIC, streams=True),
)
async def messages(
    request: Request, admitted: AnthropicAdmitted, generator: GeneratorDep
) -> Response:
    return await _generate(MESSAGES, request, admitted, generator)


@anthropic_router.post(
    "/v1/messages/count_tokens",
    openapi_extra=json_body(
        MessagesRequest.json_schema(), summary="Count a Messages request's prompt tokens"
    ),
    responses=answers(ErrorShape.ANTHROPIC, streams=False),
)
async def count_tokens(frontend: FrontendDep, _key: AnthropicKey, body: Body) -> Response:
    count = await run_in_threadpool(frontend.count_tokens, body)
    return JSONResponse({"input_tokens": count})


async def _generate(
    route: Route,
    request: Request,
    admitted: Admitted,
    generator: _Generator,
    stateful: tuple[ResponsesTurn, ResponsesState] | None = None,
) -> Response:
    """Prepare the request off the loop and answer it; the slot goes back when it has ended.

    `stateful`: a Responses turn that continues, stores or backgrounds, and where to."""
    frontend = generator.frontend
    try:
        prepared = await run_in_threadpool(
            frontend.prepare,
            route,
            admitted.body,
            request.headers.get(CACHE_CLASS_HEADER, "chat"),
            request.headers.get(SEED_HEADER),
        )
    except BaseException:
        admitted.leave()
        raise
    note(model=prepared.model)
    if generator.log_prompts:
        note(prompt=prompt_of(admitted.body))
    timer = RequestTimer(generator.metrics)

    def charge() -> None:
        usage = prepared.prompt_usage
        prompt, cached = (usage.prompt_tokens, usage.prompt_cache_hit_tokens) if usage else (0, 0)
        generator.gateway.charge(admitted.key, prompt, cached, timer.output_tokens)

    delivery = Delivery(
        route.path, route.shape, admitted, timer, _response_headers(prepared), charge
    )
    recorder = None
    if stateful is not None:
        turn, state = stateful
        recorder = TurnRecorder(turn, state.store, prepared.inference.request_id)
        if turn.background:
            return await _background(delivery, frontend.sse(prepared, timer), recorder, state)
    if prepared.converted.stream:
        sse = frontend.sse(prepared, timer)
        return await _stream(delivery, recorder.frames(sse) if recorder else sse, prepared)
    body = frontend.complete(prepared, timer)
    return await complete(delivery, _recorded(body, recorder) if recorder else body, request)


async def _recorded(body: Awaitable[str], recorder: TurnRecorder) -> str:
    return recorder.body(await body)


async def _background(
    delivery: Delivery, sse: AsyncIterator[bytes], recorder: TurnRecorder, state: ResponsesState
) -> Response:
    """Answer with the response as it starts and run the rest in a task that stores it."""
    try:
        first = recorder.turn.stamp((await anext(sse)).decode())
    except InferenceError as error:
        await sse.aclose()
        delivery.end("failed")
        return error_response(delivery.shape, ApiError(error.status_code, str(error)))
    except BaseException:
        await sse.aclose()
        delivery.end("failed")
        raise
    started = event_response(first.encode())
    state.background.start(recorder, started, sse, delivery.end)
    return Response(started, media_type="application/json", headers=delivery.headers)


async def _stream(
    delivery: Delivery, sse: AsyncIterator[bytes], prepared: PreparedRequest
) -> Response:
    if prepared.inference.sampling.structured_output is None:
        return event_stream(delivery, sse)
    # Wait until the engine has taken the request: a grammar that does not compile then
    # answers 400 in the dialect's shape, not a 200 stream that fails.
    try:
        first = await anext(sse)
    except InferenceError as error:
        await sse.aclose()
        delivery.admitted.leave()
        delivery.timer.finish(delivery.path, "failed")
        return error_response(delivery.shape, ApiError(error.status_code, str(error)))
    except BaseException:
        await sse.aclose()
        delivery.admitted.leave()
        raise
    return event_stream(delivery, sse, (first,))


def _response_headers(prepared: PreparedRequest) -> dict[str, str]:
    headers = {SEED_HEADER: str(prepared.inference.sampling.seed)}
    if prepared.unenforced_keywords:
        headers[UNENFORCED_HEADER] = ", ".join(prepared.unenforced_keywords)
    if prepared.images_not_seen:
        headers[IMAGES_NOT_SEEN_HEADER] = str(prepared.images_not_seen)
    return headers
