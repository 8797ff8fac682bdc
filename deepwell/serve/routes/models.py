"""`GET /v1/models` and `GET /v1/models/{name}`: the served names, in one entry shape both
SDKs read."""

from __future__ import annotations

import time

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from deepwell.serve.errors import ApiError, ErrorShape
from deepwell.serve.model import ServedModel
from deepwell.serve.routes.access import EitherKey
from deepwell.serve.routes.dialect_route import dialect_route
from deepwell.serve.routes.parts import CreatedDep, ModelDep

router = APIRouter(route_class=dialect_route(ErrorShape.OPENAI))


@router.get("/v1/models")
async def models(model: ModelDep, created: CreatedDep, _key: EitherKey) -> Response:
    names = model.names
    return JSONResponse(
        {
            "object": "list",
            "data": [_entry(model, created, name) for name in names],
            "has_more": False,
            "first_id": names[0],
            "last_id": names[-1],
        }
    )


@router.get("/v1/models/{name:path}")
async def model_by_id(name: str, model: ModelDep, created: CreatedDep, _key: EitherKey) -> Response:
    if name not in model.names:
        raise ApiError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )
    return JSONResponse(_entry(model, created, name))


def _entry(model: ServedModel, created: int, name: str) -> dict:
    # OpenAI's `object`/`owned_by`, Anthropic's `type`, and vLLM's `max_model_len`.
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
