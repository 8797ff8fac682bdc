"""What every route works with: the served model, settings, frontend, engine and meters.

One `ServeContext` per app, kept on `app.state` and handed to routes by the `Context` dependency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from deepwell.serve.completions import Completions
from deepwell.serve.engine_client import EngineClient
from deepwell.serve.errors import ApiError
from deepwell.serve.frontend import Frontend
from deepwell.serve.gateway import Gateway
from deepwell.serve.metrics import ServeMetrics
from deepwell.serve.model import ServedModel
from deepwell.serve.settings import ServeSettings


class Admission:
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


@dataclass(frozen=True)
class ServeContext:
    """`engine` is None on a server without workers (`--mock`, a custom inference source);
    `completions` is None unless raw-prompt completions can run (an engine and a tokenizer)."""

    model: ServedModel
    settings: ServeSettings
    frontend: Frontend
    metrics: ServeMetrics
    gateway: Gateway
    admission: Admission
    engine: EngineClient | None
    completions: Completions | None
    # When the app started: the `created` time of every model entry.
    created: int


def serve_context(request: Request) -> ServeContext:
    return request.app.state.serve_context


Context = Annotated[ServeContext, Depends(serve_context)]
