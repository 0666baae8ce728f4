"""OpenAPI schemas for routes whose bodies are msgspec structs, which FastAPI cannot see.

Routes that decode their own bodies declare them through ``openapi_extra``; `Schemas` turns a
msgspec type into a ``$ref`` there and keeps the referenced component schemas, which `install`
adds to the app's generated document, so ``/docs`` shows the real request and reply shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api.codec import JSON, MSGPACK

__all__ = ["Schemas"]

_REF = "#/components/schemas/{name}"


class Schemas:
    """Component schemas gathered from the routes' msgspec types."""

    def __init__(self) -> None:
        self._components: dict[str, Any] = {}
        self._paths: dict[str, dict[str, Any]] = {}

    def add_path(self, path: str, method: str, operation: dict[str, Any]) -> None:
        """A route FastAPI does not know (answered by an ASGI layer in front: the OpenAI proxy)."""
        self._paths.setdefault(path, {})[method] = operation

    def schema(self, body_type: Any) -> dict[str, Any]:
        (schema,), components = msgspec.json.schema_components([body_type], ref_template=_REF)
        self._components.update(components)
        return schema

    def operation(
        self,
        request: Any | None = None,
        responses: Mapping[int, tuple[Any, str]] | None = None,
        msgpack: bool = True,
    ) -> dict[str, Any]:
        """``openapi_extra`` for one route: its request body and its replies by status."""
        extra: dict[str, Any] = {}
        if request is not None:
            schema = self.schema(request)
            content = {JSON: {"schema": schema}}
            if msgpack:
                content[MSGPACK] = {"schema": schema}
            extra["requestBody"] = {"required": True, "content": content}
        if responses:
            extra["responses"] = {
                str(status): {"description": text, "content": {JSON: {"schema": self.schema(t)}}}
                for status, (t, text) in responses.items()
            }
        return extra

    def install(self, app: FastAPI) -> None:
        """Make ``app.openapi()`` include the gathered components (generated once, then cached)."""

        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                document = get_openapi(
                    title=app.title, version=app.version, description=app.description, routes=app.routes
                )
                document.setdefault("components", {}).setdefault("schemas", {}).update(self._components)
                for path, operations in self._paths.items():
                    document.setdefault("paths", {}).setdefault(path, {}).update(operations)
                app.openapi_schema = document
            return app.openapi_schema

        app.openapi = openapi  # type: ignore[method-assign]
