"""The app's /openapi.json with every route's request body: the handlers read the raw body and validate it
themselves (protocol*.py, strict, 400s naming the field), so FastAPI cannot infer the schemas; they are
added here from the same pydantic models, plus the error response every route can give."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .protocol_anthropic import CountTokensRequest, MessagesRequest
from .protocol_responses import ResponsesRequest

REQUEST_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest,
                  "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest,
                  "/detokenize": DetokenizeRequest}

_REF = "#/components/schemas/{model}"
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "object"}}}
# one server-sent event, as an SSE parser gives it
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
# JSON responses of the POST routes (streams are text/event-stream)
RESPONSES = {
    "/tokenize": {"type": "object", "required": ["count", "max_model_len", "tokens"],
                  "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                                 "tokens": {"type": "array", "items": {"type": "integer"}},
                                 "token_strs": {"anyOf": [{"type": "array"}, {"type": "null"}]}}},
    "/detokenize": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    "/v1/messages/count_tokens": {"type": "object", "required": ["input_tokens"],
                                  "properties": {"input_tokens": {"type": "integer"}}},
    "/v1/messages": {"type": "object", "required": ["id", "type", "role", "content", "stop_reason", "usage"]},
    "/v1/responses": {"type": "object", "required": ["id", "object", "status", "output"]},
    "/v1/completions": {"type": "object", "required": ["id", "object", "choices"]},
    "/v1/chat/completions": {"type": "object", "required": ["id", "object", "choices"]},
}


def install_openapi(app: FastAPI) -> None:
    """Make app.openapi() add the request bodies and JSON responses to FastAPI's own document."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = default()
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        components["Error"] = _ERROR
        for path, model in REQUEST_BODIES.items():
            operation = doc["paths"].get(path, {}).get("post")
            if operation is None:
                continue
            schema = model.model_json_schema(ref_template=_REF)
            components.update(schema.pop("$defs", {}))
            components[model.__name__] = schema
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF.format(model=model.__name__)}}}}
            responses = operation.setdefault("responses", {})
            ok: dict[str, Any] = {"application/json": {"schema": RESPONSES.get(path, {"type": "object"})}}
            if "stream" in model.model_fields:
                ok["text/event-stream"] = {"schema": _SSE_EVENT}
            responses["200"] = {"description": "Successful Response", "content": ok}
            responses.pop("422", None)   # FastAPI's own validation never runs on these routes
            responses["4XX"] = {"description": "Refused (the body names the field)",
                                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
