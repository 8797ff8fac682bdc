"""The stored Responses routes: retrieve, list input items, delete, cancel a background one.

`POST /v1/responses` itself is in generation.py; it stores what `store: true` asks for.
"""

from __future__ import annotations

import json
from typing import Literal

from fastapi import APIRouter, Query
from starlette.responses import JSONResponse, Response

from deepwell.serve.errors import ApiError, ErrorShape
from deepwell.serve.responses_store import RUNNING
from deepwell.serve.routes.access import OpenAIKey
from deepwell.serve.routes.dialect_route import dialect_route
from deepwell.serve.routes.parts import ResponsesDep
from deepwell.serve.stored_responses import stored_or_404

router = APIRouter(route_class=dialect_route(ErrorShape.OPENAI))


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, state: ResponsesDep, _key: OpenAIKey) -> Response:
    stored = stored_or_404(state.store, response_id)
    return Response(stored.response, media_type="application/json")


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(
    response_id: str,
    state: ResponsesDep,
    _key: OpenAIKey,
    order: Literal["asc", "desc"] = "desc",
    limit: int = Query(20, ge=1, le=100),
    after: str | None = None,
) -> Response:
    """OpenAI's list of a response's input items: newest first unless `order=asc`, `limit`
    at a time, continuing `after` an item id."""
    items = stored_or_404(state.store, response_id).input_items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(
                400, f"no input item '{after}' in response '{response_id}'", param="after"
            )
        items = items[ids.index(after) + 1 :]
    page = [_listed(item) for item in items[:limit]]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, state: ResponsesDep, _key: OpenAIKey) -> Response:
    stored_or_404(state.store, response_id)
    await state.background.cancel(response_id)
    state.store.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel(response_id: str, state: ResponsesDep, _key: OpenAIKey) -> Response:
    """Stop a background response; one that has ended is answered as it stands."""
    stored = stored_or_404(state.store, response_id)
    if not json.loads(stored.response).get("background"):
        raise ApiError(
            400,
            f"Response '{response_id}' is not a background response; only "
            "background responses can be cancelled.",
        )
    if stored.status in RUNNING:
        await state.background.cancel(response_id)
        stored = stored_or_404(state.store, response_id)
    return Response(stored.response, media_type="application/json")


def _listed(item: dict) -> dict:
    """An input item as OpenAI lists it: a message's text content as one input_text part
    (the stored item keeps the form it was sent in, which rebuilds the prompt exactly)."""
    if item.get("type", "message") == "message" and isinstance(item.get("content"), str):
        return {**item, "content": [{"type": "input_text", "text": item["content"]}]}
    return item
