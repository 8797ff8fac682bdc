"""vLLM's `POST /tokenize` and `POST /detokenize` on the served model's tokenizer."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from deepwell.serve.errors import ErrorShape
from deepwell.serve.routes.access import Body, OpenAIKey
from deepwell.serve.routes.dialect_route import dialect_route
from deepwell.serve.routes.parts import FrontendDep, ModelDep
from deepwell.serve.tokenize import detokenize, tokenize

router = APIRouter(route_class=dialect_route(ErrorShape.OPENAI))


@router.post("/tokenize")
async def tokenize_route(frontend: FrontendDep, _key: OpenAIKey, body: Body) -> Response:
    return JSONResponse(await run_in_threadpool(tokenize, frontend, body))


@router.post("/detokenize")
async def detokenize_route(model: ModelDep, _key: OpenAIKey, body: Body) -> Response:
    return JSONResponse(await run_in_threadpool(detokenize, model, body))
