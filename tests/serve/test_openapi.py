"""`/openapi.json` and `/docs`: every dialect route with the schema of the body its reader
reads, a document that validates as OpenAPI 3, a page that needs no network, and both off
with `--disable-docs`."""

from __future__ import annotations

import argparse
import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate

from deepwell.serve.api import create_app
from deepwell.serve.settings import ServeSettings, add_arguments
from tests.serve.test_errors import JSON_ROUTES, MODEL

DIALECT_ROUTES = {
    "/v1/chat/completions": ("ChatCompletionRequest", "messages"),
    "/v1/responses": ("ResponsesRequest", "input"),
    "/v1/messages": ("MessagesRequest", "messages"),
    "/v1/messages/count_tokens": ("MessagesRequest", "messages"),
    "/v1/completions": ("CompletionRequest", "best_of"),
}


def get(path: str, settings: ServeSettings | None = None) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=create_app(settings=settings))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path)

    return asyncio.run(run())


@pytest.fixture(scope="module")
def document() -> dict:
    response = get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_the_document_validates_as_openapi_3(document):
    assert document["openapi"].startswith("3.")
    validate(document)


@pytest.mark.parametrize("path", DIALECT_ROUTES)
def test_every_dialect_route_has_its_request_body_schema(document, path):
    title, field = DIALECT_ROUTES[path]
    operation = document["paths"][path]["post"]
    body = operation["requestBody"]
    assert body["required"]
    schema = body["content"]["application/json"]["schema"]
    assert schema["title"] == title and field in schema["properties"]
    assert "model" in schema["required"]
    jsonschema.Draft202012Validator.check_schema(schema)
    # The route's own example body is one its schema accepts.
    example = {**JSON_ROUTES[path], "model": MODEL}
    jsonschema.validate(example, schema)
    # Errors are described in the route's dialect shape.
    error = operation["responses"]["415"]["content"]["application/json"]["schema"]
    assert error["title"] == ("AnthropicError" if "messages" in path else "OpenAIError")


def test_the_docs_page_lists_the_document_and_loads_nothing_from_elsewhere():
    page = get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/openapi.json" in page.text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text)


def test_disable_docs_takes_both_away_answering_in_openais_shape():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--disable-docs"]).disable_docs
    assert not parser.parse_args([]).disable_docs
    for path in ("/openapi.json", "/docs"):
        response = get(path, ServeSettings(docs=False))
        assert response.status_code == 404
        assert path in response.json()["error"]["message"]
    assert json.loads(get("/openapi.json").text)["paths"]


def test_the_media_type_walk_covers_every_route_the_document_gives_a_body(document):
    with_bodies = {
        path
        for path, operations in document["paths"].items()
        for operation in operations.values()
        if "requestBody" in operation
    }
    assert with_bodies <= set(JSON_ROUTES)
