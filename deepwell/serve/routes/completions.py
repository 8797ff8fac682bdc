"""`POST /v1/completions`: raw prompts run on the engine, no chat encoding."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from deepwell.serve.completions import request_schema
from deepwell.serve.errors import ApiError, ErrorShape
from deepwell.serve.frontend import SEED_HEADER
from deepwell.serve.metrics import RequestTimer
from deepwell.serve.openapi import answers, json_body
from deepwell.serve.request_log import note, prompt_of
from deepwell.serve.routes.access import OpenAIAdmitted
from deepwell.serve.routes.delivery import Delivery, complete, event_stream
from deepwell.serve.routes.dialect_route import dialect_route
from deepwell.serve.routes.parts import CompletionsDep, GatewayDep, MetricsDep, SettingsDep

PATH = "/v1/completions"
router = APIRouter(route_class=dialect_route(ErrorShape.OPENAI))


@router.post(
    PATH,
    openapi_extra=json_body(request_schema(), summary="Completions of raw prompts"),
    responses=answers(ErrorShape.OPENAI, streams=True),
)
async def text_completions(
    request: Request,
    admitted: OpenAIAdmitted,
    completions: CompletionsDep,
    metrics: MetricsDep,
    gateway: GatewayDep,
    settings: SettingsDep,
) -> Response:
    try:
        if completions is None:
            raise ApiError(400, f"{PATH} needs a model; this server runs --mock.")
        prepared = await run_in_threadpool(completions.prepare, admitted.body)
    except BaseException:
        admitted.leave()
        raise
    note(model=prepared.model)
    if settings.log_prompts:
        note(prompt=prompt_of(admitted.body))
    timer = RequestTimer(metrics)
    prompt_tokens = sum(len(prompt) for prompt in prepared.prompts)

    def charge() -> None:
        gateway.charge(admitted.key, prompt_tokens, 0, timer.output_tokens)

    headers = {SEED_HEADER: str(prepared.sampling.seed)}
    delivery = Delivery(PATH, ErrorShape.OPENAI, admitted, timer, headers, charge)
    if prepared.stream:
        return event_stream(delivery, completions.sse(prepared, timer))
    return await complete(delivery, completions.complete(prepared, timer), request)
