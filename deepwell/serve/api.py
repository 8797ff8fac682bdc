"""The FastAPI app: the three dialects' routes, models, health and metrics; API keys and limits.

Every refusal comes in the route's dialect error shape; a client that goes away mid-request
closes its chunk stream, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

import deepwell
from deepwell.recipe import ConversionError
from deepwell.serve.cluster.admin import add_admin_routes
from deepwell.serve.cluster.metrics import ClusterCollector
from deepwell.serve.completions import Completions
from deepwell.serve.engine_client import EngineClient, InferenceError
from deepwell.serve.errors import (
    ApiError,
    ErrorShape,
    conversion_error_response,
    error_object,
    error_response,
)
from deepwell.serve.frontend import (
    CACHE_CLASS_HEADER,
    CHAT,
    MESSAGES,
    RESPONSES,
    SEED_HEADER,
    UNENFORCED_HEADER,
    Frontend,
    Infer,
    PreparedRequest,
    Route,
    engine_infer,
    mock_infer,
    sse_frame,
)
from deepwell.serve.gateway import Gateway, GatewayCollector
from deepwell.serve.messages import ModelInfo, WorkerStats
from deepwell.serve.metrics import RequestTimer, ServeMetrics
from deepwell.serve.model import ServedModel, mock_model
from deepwell.serve.playground import ROUTES, STATIC_DIR, dialect_of, render, replay
from deepwell.serve.settings import ServeSettings
from deepwell.serve.tokenize import detokenize, tokenize

logger = logging.getLogger(__name__)


class _Admission:
    """Counts admitted requests against the pending limit."""

    def __init__(self, limit: int, retry_after: int) -> None:
        self.limit = limit
        self.retry_after = retry_after
        self.pending = 0

    def enter(self) -> None:
        if self.pending >= self.limit:
            raise ApiError(
                429,
                f"The server is at capacity ({self.limit} requests in progress); retry later.",
                {"Retry-After": str(self.retry_after)},
            )
        self.pending += 1

    def leave(self) -> None:
        self.pending -= 1


class _EventStream(StreamingResponse):
    """An SSE response that also watches for the client leaving and reports how it ended."""

    def __init__(
        self,
        frames: AsyncIterator[bytes],
        on_close: Callable[[str], None],
        headers: dict[str, str],
    ) -> None:
        super().__init__(frames, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome = "aborted"
        streaming = asyncio.ensure_future(self.stream_response(send))
        disconnect = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait(
                {streaming, disconnect}, return_when=asyncio.FIRST_COMPLETED
            )
            if streaming in done:
                error = streaming.exception()
                if error is None:
                    outcome = "completed"
                elif not isinstance(error, OSError):  # OSError: the client went away
                    outcome = "failed"
                    logger.error("stream failed", exc_info=error)
        finally:
            streaming.cancel()
            disconnect.cancel()
            await asyncio.gather(streaming, disconnect, return_exceptions=True)
            await self.body_iterator.aclose()
            self._on_close(outcome)


def create_app(
    *,
    infer: Infer | None = None,
    model: ServedModel | None = None,
    settings: ServeSettings | None = None,
    engine: EngineClient | None = None,
    model_info: ModelInfo | None = None,
) -> FastAPI:
    """The HTTP app. With no `infer` and no `engine` it serves the mock reply (`--mock`).

    `infer` may be any async source of `InferenceChunk`s (text or tokens); with `engine`
    the app runs requests on engine workers and reads their load for `/metrics`;
    `model_info` (what the workers loaded) adds their compute dtype to `/metrics`.
    """
    model = model or mock_model()
    settings = settings or ServeSettings()
    if infer is None:
        infer = engine_infer(engine, model.stop_token_ids) if engine is not None else mock_infer
    admission = _Admission(settings.max_pending_requests, settings.retry_after_seconds)

    def stats() -> WorkerStats:
        if engine is not None:
            return engine.stats()
        return WorkerStats(
            running=admission.pending, waiting=0, kv_blocks_used=0, kv_blocks_total=0
        )

    metrics = ServeMetrics(stats)
    gateway = Gateway(settings.key_tokens_per_minute)
    metrics.registry.register(GatewayCollector(gateway))
    if engine is not None:
        metrics.registry.register(ClusterCollector(engine.workers, engine.latency))
    if model_info is not None:
        metrics.compute_dtype.info(
            {"dtype": model_info.dtype, "requested": model_info.requested_dtype}
        )
    frontend = Frontend(model, infer, settings.default_seed)
    # Raw-prompt completions run on the engine directly: no chat encoding, no Infer seam.
    completions = (
        Completions(model, engine, frontend.request_seed)
        if engine is not None and model.tokenizer is not None
        else None
    )
    app = FastAPI(title="deepwell", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    def authorize(request: Request, shape: ErrorShape | None) -> str | None:
        """OpenAI routes take `Authorization: Bearer`, Anthropic routes `x-api-key` (or Bearer).

        Returns the key presented, None on a server without keys.
        """
        if not settings.api_keys:
            return None
        bearer = request.headers.get("authorization", "")
        presented = [bearer[7:].strip()] if bearer[:7].lower() == "bearer " else []
        if shape is not ErrorShape.OPENAI:
            presented.append(request.headers.get("x-api-key", ""))
        for key in presented:
            if any(hmac.compare_digest(key.encode(), k.encode()) for k in settings.api_keys):
                return key
        header = "Authorization: Bearer" if shape is ErrorShape.OPENAI else "x-api-key"
        raise ApiError(401, f"Invalid or missing API key; pass it in the {header} header.")

    async def read_body(request: Request) -> bytes:
        limit = settings.max_body_bytes
        too_large = ApiError(413, f"The request body exceeds the limit of {limit} bytes.")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise too_large
        return bytes(body)

    async def enter(request: Request, shape: ErrorShape) -> tuple[str | None, bytes]:
        """Check the key and its token allowance, read the body, take an admission slot
        (the caller leaves it); the key presented and the body."""
        key = authorize(request, shape)
        gateway.admit(key)
        body = await read_body(request)
        admission.enter()
        return key, body

    async def generate(route: Route, request: Request) -> Response:
        shape = route.shape
        try:
            key, body = await enter(request, shape)
        except ApiError as error:
            return error_response(shape, error)
        try:
            cache_class = request.headers.get(CACHE_CLASS_HEADER, "chat")
            prepared = await run_in_threadpool(
                frontend.prepare, route, body, cache_class, request.headers.get(SEED_HEADER)
            )
        except _REFUSALS as error:
            admission.leave()
            return _refusal(shape, error)
        except BaseException:
            admission.leave()
            raise
        timer = RequestTimer(metrics)
        headers = _response_headers(prepared)
        if prepared.converted.stream:
            return await _stream(prepared, timer, key)
        body = frontend.complete(prepared, timer)
        return await _complete(
            route.path, shape, body, timer, request, headers, lambda: bill(key, prepared, timer)
        )

    def bill(key: str | None, prepared: PreparedRequest, timer: RequestTimer) -> None:
        usage = prepared.prompt_usage
        prompt, cached = (usage.prompt_tokens, usage.prompt_cache_hit_tokens) if usage else (0, 0)
        gateway.charge(key, prompt, cached, timer.output_tokens)

    async def _stream(prepared: PreparedRequest, timer: RequestTimer, key: str | None) -> Response:
        route = prepared.route
        sse = frontend.sse(prepared, timer)
        first: list[bytes] = []
        if prepared.inference.structured_output is not None:
            # Wait until the engine has taken the request: a grammar that does not compile
            # then answers 400 in the dialect's shape, not a 200 stream that fails.
            try:
                first.append(await anext(sse))
            except InferenceError as error:
                await sse.aclose()
                admission.leave()
                timer.finish(route.path, "failed")
                return error_response(route.shape, ApiError(error.status_code, str(error)))
            except BaseException:
                await sse.aclose()
                admission.leave()
                raise
        return _event_stream(
            route.path,
            route.shape,
            sse,
            timer,
            _response_headers(prepared),
            first,
            lambda: bill(key, prepared, timer),
        )

    def _event_stream(
        path: str,
        shape: ErrorShape,
        sse: AsyncIterator[bytes],
        timer: RequestTimer,
        headers: dict[str, str],
        first: list[bytes],
        charge: Callable[[], None],
    ) -> Response:
        async def frames() -> AsyncIterator[bytes]:
            try:
                for frame in first:
                    yield frame
                async for frame in sse:
                    yield frame
            except InferenceError as error:
                yield _error_frame(shape, error.status_code, str(error))
            except Exception as error:  # a bug: end the stream in the dialect's shape
                logger.error("stream failed on %s", path, exc_info=error)
                yield _error_frame(shape, 500, f"Internal error: {type(error).__name__}")
            finally:
                await sse.aclose()

        def on_close(outcome: str) -> None:
            admission.leave()
            timer.finish(path, outcome)
            charge()

        return _EventStream(frames(), on_close, headers)

    async def _complete(
        path: str,
        shape: ErrorShape,
        body: Awaitable[str],
        timer: RequestTimer,
        request: Request,
        headers: dict[str, str],
        charge: Callable[[], None],
    ) -> Response:
        """Run a non-streamed request to its body; a client that leaves aborts it."""
        outcome = "aborted"
        result = asyncio.ensure_future(body)
        disconnect = asyncio.ensure_future(_wait_for_disconnect(request.receive))
        try:
            await asyncio.wait({result, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if not result.done():
                return Response(status_code=499)
            try:
                content = result.result()
            except InferenceError as error:
                outcome = "failed"
                return error_response(shape, ApiError(error.status_code, str(error)))
            outcome = "completed"
            return Response(content, media_type="application/json", headers=headers)
        finally:
            result.cancel()
            disconnect.cancel()
            await asyncio.gather(result, disconnect, return_exceptions=True)
            admission.leave()
            timer.finish(path, outcome)
            charge()

    async def internal_error(request: Request, error: Exception) -> Response:
        # A bug, not bad input: still answer in the route's shape, and log it.
        logger.error("unhandled error on %s", request.url.path, exc_info=error)
        shape = _shape_of(request.url.path)
        return error_response(shape, ApiError(500, f"Internal error: {type(error).__name__}"))

    app.add_exception_handler(Exception, internal_error)

    @app.post(CHAT.path)
    async def chat_completions(request: Request) -> Response:
        return await generate(CHAT, request)

    @app.post(RESPONSES.path)
    async def responses(request: Request) -> Response:
        return await generate(RESPONSES, request)

    @app.post(MESSAGES.path)
    async def messages(request: Request) -> Response:
        return await generate(MESSAGES, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        shape = ErrorShape.ANTHROPIC
        try:
            authorize(request, shape)
            body = await read_body(request)
            count = await run_in_threadpool(frontend.count_tokens, body)
        except _REFUSALS as error:
            return _refusal(shape, error)
        return JSONResponse({"input_tokens": count})

    @app.post("/v1/completions")
    async def text_completions(request: Request) -> Response:
        shape, path = ErrorShape.OPENAI, "/v1/completions"
        try:
            key, body = await enter(request, shape)
        except ApiError as error:
            return error_response(shape, error)
        try:
            if completions is None:
                raise ApiError(400, "/v1/completions needs a model; this server runs --mock.")
            prepared = await run_in_threadpool(completions.prepare, body)
        except _REFUSALS as error:
            admission.leave()
            return _refusal(shape, error)
        timer = RequestTimer(metrics)
        headers = {SEED_HEADER: str(prepared.seed)}
        prompt_tokens = sum(len(prompt) for prompt in prepared.prompts)

        def charge() -> None:
            gateway.charge(key, prompt_tokens, 0, timer.output_tokens)

        if prepared.stream:
            sse = completions.sse(prepared, timer)
            return _event_stream(path, shape, sse, timer, headers, [], charge)
        result = completions.complete(prepared, timer)
        return await _complete(path, shape, result, timer, request, headers, charge)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await _token_route(request, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await _token_route(request, detokenize)

    async def _token_route(request: Request, handler) -> Response:
        try:
            authorize(request, ErrorShape.OPENAI)
            body = await read_body(request)
            result = await run_in_threadpool(handler, model, body)
        except _REFUSALS as error:
            return _refusal(ErrorShape.OPENAI, error)
        return JSONResponse(result)

    def model_entry(name: str) -> dict:
        # One entry both SDKs read: OpenAI's `object`/`owned_by`, Anthropic's `type`, and
        # vLLM's `max_model_len`.
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "deepwell",
            "type": "model",
            "display_name": name,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
            "max_model_len": model.context_limit,
        }

    @app.get("/v1/models/{name:path}")
    async def model_by_id(name: str, request: Request) -> Response:
        try:
            authorize(request, None)
            if name not in model.names:
                raise ApiError(
                    404,
                    f"The model `{name}` does not exist.",
                    param="model",
                    code="model_not_found",
                )
        except ApiError as error:
            return error_response(ErrorShape.OPENAI, error)
        return JSONResponse(model_entry(name))

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": deepwell.__version__})

    @app.post("/v1/render")
    async def render_prompt(request: Request, dialect: str | None = None) -> Response:
        shape = ErrorShape.OPENAI
        try:
            body = await read_body(request)
            dialect = dialect_of(body, dialect)
            shape = ROUTES[dialect].shape
            authorize(request, shape)
            rendered = await run_in_threadpool(render, frontend, dialect, body)
        except _REFUSALS as error:
            return _refusal(shape, error)
        return JSONResponse(asdict(rendered))

    @app.post("/v1/replay")
    async def replay_output(request: Request) -> Response:
        try:
            authorize(request, None)
            fields = _replay_fields(await read_body(request))
            dialect = dialect_of(fields.request, fields.dialect)
        except _REFUSALS as error:
            return _refusal(ErrorShape.OPENAI, error)
        try:
            result = await run_in_threadpool(
                replay, frontend, dialect, fields.request, fields.output
            )
        except _REFUSALS as error:
            return _refusal(ROUTES[dialect].shape, error)
        return JSONResponse(asdict(result))

    if settings.playground:
        # The page and its scripts are public; every call they make carries the key the
        # user typed into the page.
        @app.get("/playground")
        async def playground_root() -> Response:
            return RedirectResponse("/playground/")

        app.mount("/playground", StaticFiles(directory=STATIC_DIR, html=True), "playground")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            authorize(request, None)
        except ApiError as error:
            return error_response(ErrorShape.OPENAI, error)
        data = [model_entry(name) for name in model.names]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "has_more": False,
                "first_id": model.names[0],
                "last_id": model.names[-1],
            }
        )

    @app.get("/health")
    async def health() -> Response:
        if engine is not None and not engine.healthy:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    if engine is not None:
        add_admin_routes(
            app,
            engine,
            lambda request: authorize(request, ErrorShape.OPENAI),
            settings.drain_max_utilisation,
            settings.drain_timeout_s,
        )
    return app


# What a request can be refused with before it runs: the service's own checks, the recipe's
# conversion errors, and what the recipe raises for bodies it cannot read or encode (spec §1).
_REFUSALS = (ApiError, ConversionError, ValueError, RuntimeError, RecursionError, OverflowError)


@dataclass(frozen=True)
class _ReplayFields:
    """The body of `POST /v1/replay`: a request (JSON text or object), its dialect (None:
    guessed) and the raw model output to replay."""

    request: str
    dialect: str | None
    output: str


def _replay_fields(body: bytes) -> _ReplayFields:
    try:
        data = json.loads(body)
    except ValueError as error:
        raise ApiError(400, f"invalid JSON body: {error}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be an object with `request` and `output`")
    request, dialect, output = data.get("request"), data.get("dialect"), data.get("output")
    if isinstance(request, dict):
        request = json.dumps(request)
    if not isinstance(request, str):
        raise ApiError(400, "`request` must be a request body: a JSON object or its text")
    if dialect is not None and not isinstance(dialect, str):
        raise ApiError(400, "`dialect` must be a string")
    if not isinstance(output, str):
        raise ApiError(400, "`output` must be a string: the model's raw output")
    return _ReplayFields(request, dialect, output)


def _response_headers(prepared: PreparedRequest) -> dict[str, str]:
    headers = {SEED_HEADER: str(prepared.inference.seed)}
    if prepared.unenforced_keywords:
        headers[UNENFORCED_HEADER] = ", ".join(prepared.unenforced_keywords)
    return headers


def _refusal(shape: ErrorShape, error: Exception) -> Response:
    if isinstance(error, ApiError):
        return error_response(shape, error)
    if isinstance(error, ConversionError):
        return conversion_error_response(shape, error)
    return error_response(shape, ApiError(400, str(error)))


def _shape_of(path: str) -> ErrorShape:
    return ErrorShape.ANTHROPIC if path.startswith(MESSAGES.path) else ErrorShape.OPENAI


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _error_frame(shape: ErrorShape, status_code: int, message: str) -> bytes:
    """The error a stream ends with when inference fails after the response has started."""
    body = error_object(shape, status_code, message)
    if shape is ErrorShape.ANTHROPIC:
        return sse_frame("error", json.dumps(body))
    return sse_frame(None, json.dumps(body))
