"""CORS for `serve --allowed-origins`: a browser app on an allowed origin may call the API;
a request from any other origin is answered as if CORS did not exist (no CORS headers).

Starlette's middleware answers the allowed origins; the others bypass it, since it would
answer their preflight with a 400 that still carries its allowed methods and headers.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from deepwell.serve.errors import REQUEST_ID_HEADERS
from deepwell.serve.frontend import SEED_HEADER, UNENFORCED_HEADER
from deepwell.serve.images.intake import IMAGES_NOT_SEEN_HEADER

ANY_ORIGIN = "*"
_METHODS = ("GET", "POST", "DELETE", "OPTIONS")
# The response headers a browser app may read: ids, seeds and what the server did not do.
_EXPOSED = (*REQUEST_ID_HEADERS, SEED_HEADER, UNENFORCED_HEADER, IMAGES_NOT_SEEN_HEADER)


class CrossOrigin:
    """ASGI middleware: CORS headers for the `allowed` origins (`*`: every origin)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app = app
        self.allowed = frozenset(origin.rstrip("/") for origin in allowed)
        self.cors = CORSMiddleware(
            app,
            allow_origins=sorted(self.allowed),
            allow_methods=_METHODS,
            # Authorization, x-api-key, anthropic-version, the SDKs' x-stainless-* ...
            allow_headers=["*"],
            expose_headers=_EXPOSED,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._allows(Headers(scope=scope).get("origin")):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _allows(self, origin: str | None) -> bool:
        return origin is not None and (ANY_ORIGIN in self.allowed or origin in self.allowed)
