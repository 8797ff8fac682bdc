"""The FastAPI app: assembles its parts (deepwell.serve.routes.parts) and includes the routers
of deepwell.serve.routes, one per concern.

Every refusal comes in the route's dialect error shape; a client that goes away mid-request
closes its chunk stream, which aborts the request in the engine.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.exceptions import HTTPException

from deepwell import __version__
from deepwell.serve.cluster import admin
from deepwell.serve.cluster.assembly import Cluster
from deepwell.serve.cluster.metrics import ClusterCollector
from deepwell.serve.completions import Completions
from deepwell.serve.cross_origin import CrossOrigin
from deepwell.serve.frontend import Frontend, Infer, engine_infer, mock_infer
from deepwell.serve.gateway import Gateway, GatewayCollector
from deepwell.serve.images.intake import ImageIntake
from deepwell.serve.images.pool import PoolConfig
from deepwell.serve.messages import ModelInfo
from deepwell.serve.metrics import AdmissionCollector, ServeMetrics
from deepwell.serve.model import ServedModel, mock_model
from deepwell.serve.openapi import OPENAPI_PATH, serve_docs_page
from deepwell.serve.request_log import RequestLog
from deepwell.serve.responses_store import ResponseStore
from deepwell.serve.routes import (
    completions,
    generation,
    health,
    models,
    playground,
    stored,
    tokenize,
)
from deepwell.serve.routes.dialect_route import unrouted_response
from deepwell.serve.routes.parts import Admission, ServeParts
from deepwell.serve.settings import ServeSettings
from deepwell.serve.stored_responses import ResponsesState

# The routers every app serves; a cluster adds its operator routes (cluster/admin.py).
_ROUTERS = (
    generation.openai_router,
    generation.anthropic_router,
    completions.router,
    stored.router,
    tokenize.router,
    models.router,
    playground.router,
    health.router,
)


def create_app(
    *,
    infer: Infer | None = None,
    model: ServedModel | None = None,
    settings: ServeSettings | None = None,
    cluster: Cluster | None = None,
    model_info: ModelInfo | None = None,
) -> FastAPI:
    """The HTTP app. With no `infer` and no `cluster` it serves the mock reply (`--mock`).

    `infer` may be any async source of `InferenceChunk`s (text or tokens); with `cluster`
    the app runs requests on its engine workers and reads their load for `/metrics`;
    `model_info` (what the workers loaded) adds their compute dtype to `/metrics`.
    """
    parts = serve_parts(infer, model or mock_model(), settings or ServeSettings(), cluster)
    if model_info is not None:
        parts.metrics.compute_dtype.info(
            {"dtype": model_info.dtype, "requested": model_info.requested_dtype}
        )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        # The multimodal pool's processes end with the server.
        parts.frontend.images.close()

    # FastAPI's own /docs page loads its scripts from a CDN; ours is served locally.
    app = FastAPI(
        title="deepwell",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=OPENAPI_PATH if parts.settings.docs else None,
        lifespan=lifespan,
    )
    app.state.parts = parts
    app.add_exception_handler(HTTPException, unrouted_response)
    for router in _ROUTERS:
        app.include_router(router)
    if parts.settings.playground:
        playground.mount_page(app)
    if parts.settings.docs:
        serve_docs_page(app)
    if cluster is not None:
        app.include_router(admin.router)
    if parts.settings.allowed_origins:
        app.add_middleware(CrossOrigin, allowed=parts.settings.allowed_origins)
    # Outermost: every answer, CORS preflights included, gets an id and a log line.
    app.add_middleware(RequestLog)
    return app


def serve_parts(
    infer: Infer | None, model: ServedModel, settings: ServeSettings, cluster: Cluster | None
) -> ServeParts:
    """The app's parts, each built once from the ones it reads."""
    if infer is None:
        infer = engine_infer(cluster.router) if cluster is not None else mock_infer
    admission = Admission(
        settings.max_pending_requests,
        settings.retry_after_seconds,
        settings.max_waiting_requests,
        cluster.router.num_waiting if cluster is not None else lambda: 0,
    )
    metrics = ServeMetrics(cluster.pool.stats if cluster is not None else admission.load)
    gateway = Gateway(settings.key_tokens_per_minute)
    metrics.registry.register(GatewayCollector(gateway))
    metrics.registry.register(AdmissionCollector(lambda: dict(admission.rejected)))
    if cluster is not None:
        router = cluster.router
        metrics.registry.register(
            ClusterCollector(router.views, cluster.latency, lambda: router.deadline_expiries)
        )
    images = ImageIntake(model.vision, settings.images, PoolConfig.from_environment())
    frontend = Frontend(model, infer, images, settings.default_seed)
    # Raw-prompt completions run on the workers directly: no chat encoding, no Infer seam.
    raw_completions = (
        Completions(model, cluster.router, frontend.request_seed)
        if cluster is not None and model.tokenizer is not None
        else None
    )
    return ServeParts(
        model=model,
        settings=settings,
        frontend=frontend,
        metrics=metrics,
        gateway=gateway,
        admission=admission,
        cluster=cluster,
        completions=raw_completions,
        responses=ResponsesState(
            ResponseStore(
                settings.responses_store, settings.responses_ttl_s, settings.responses_max
            )
        ),
        created=int(time.time()),
    )
