"""The FastAPI app: assembles the routers of deepwell.serve.routes around one `ServeContext`.

Every refusal comes in the route's dialect error shape; a client that goes away mid-request
closes its chunk stream, which aborts the request in the engine.
"""

from __future__ import annotations

import time

from fastapi import FastAPI

from deepwell.engine.stats import EngineStats
from deepwell.serve.cluster import admin
from deepwell.serve.cluster.metrics import ClusterCollector
from deepwell.serve.completions import Completions
from deepwell.serve.engine_client import EngineClient
from deepwell.serve.frontend import Frontend, Infer, engine_infer, mock_infer
from deepwell.serve.gateway import Gateway, GatewayCollector
from deepwell.serve.messages import ModelInfo
from deepwell.serve.metrics import ServeMetrics
from deepwell.serve.model import ServedModel, mock_model
from deepwell.serve.routes import completions, generation, health, models, playground, tokenize
from deepwell.serve.routes.context import Admission, ServeContext
from deepwell.serve.settings import ServeSettings


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
    context = _context(infer, model or mock_model(), settings or ServeSettings(), engine)
    if engine is not None:
        context.metrics.registry.register(ClusterCollector(engine.workers, engine.latency))
    if model_info is not None:
        context.metrics.compute_dtype.info(
            {"dtype": model_info.dtype, "requested": model_info.requested_dtype}
        )
    app = FastAPI(title="deepwell", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve_context = context
    for router in (
        generation.openai_router,
        generation.anthropic_router,
        completions.router,
        tokenize.router,
        models.router,
        playground.router,
        health.router,
    ):
        app.include_router(router)
    if context.settings.playground:
        playground.mount_page(app)
    if engine is not None:
        app.include_router(admin.router)
    return app


def _context(
    infer: Infer | None, model: ServedModel, settings: ServeSettings, engine: EngineClient | None
) -> ServeContext:
    if infer is None:
        infer = engine_infer(engine) if engine is not None else mock_infer
    admission = Admission(settings.max_pending_requests, settings.retry_after_seconds)

    def stats() -> EngineStats:
        # Without workers the app's own admissions are the only load there is.
        if engine is not None:
            return engine.stats()
        return EngineStats(
            running=admission.pending, waiting=0, kv_blocks_used=0, kv_blocks_total=0
        )

    metrics = ServeMetrics(stats)
    gateway = Gateway(settings.key_tokens_per_minute)
    metrics.registry.register(GatewayCollector(gateway))
    frontend = Frontend(model, infer, settings.default_seed)
    # Raw-prompt completions run on the engine directly: no chat encoding, no Infer seam.
    raw_completions = (
        Completions(model, engine, frontend.request_seed)
        if engine is not None and model.tokenizer is not None
        else None
    )
    return ServeContext(
        model=model,
        settings=settings,
        frontend=frontend,
        metrics=metrics,
        gateway=gateway,
        admission=admission,
        engine=engine,
        completions=raw_completions,
        created=int(time.time()),
    )
