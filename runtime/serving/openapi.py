"""The OpenAPI description of `kvexport serve` (runtime/serving/server.py's routes): every status
a route answers with its body; validation errors are 400s (FastAPI's 422s are dropped); the POST
routes parse their own bodies off the event loop (bodies.py), so their request schemas are named
here (`request_body`, as openapi_extra) and added to the components (`schema_of`).
"""

from __future__ import annotations

from typing import Callable

from fastapi import FastAPI

from .openai_protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse


def errors(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse, "description": desc} for s, desc in (
        (400, "invalid request: `param` names the field"),
        (401, "no valid API key (a server started with --api-keys): Authorization: Bearer KEY"),
        (404, "unknown model or route"),
        (413, "request body too large"), (415, "compressed request body (Content-Encoding)"),
        (499, "the client went away"),
        (500, "the engine failed the request"), (503, "the engine has stopped or the server is shutting down"),
    ) if s in statuses}


# one server-sent event: `data:` a JSON chunk (or an error body), the last one `[DONE]`
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}


def request_body(model: type) -> dict:
    """openapi_extra of a POST route that parses its own body: its schema (added to the components by schema_of)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def generation_responses(model: type) -> dict:
    return {200: {"model": model, "description": "the completion; with `stream: true`, server-sent events of "
                                                 "chunks, then `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}},
            **errors(400, 401, 404, 413, 415, 499, 500, 503)}


def schema_of(app: FastAPI) -> Callable[[], dict]:
    """The app's `openapi()`: FastAPI's schema with the request bodies' schemas, without its 422 responses
    (validation errors are 400s here)."""
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in (CompletionRequest, ChatCompletionRequest)],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi
