"""``/docs`` (Swagger UI), ``/redoc`` and ``/openapi.json``, served without any external host.

FastAPI's own pages load Swagger UI and ReDoc from a CDN (and ReDoc's fonts from Google), which a
cluster without egress, or a laptop offline, cannot reach. The ``fastapi-offline`` package ships the
same assets; they are served from ``/docs-assets`` and the pages point there. The pages and the
OpenAPI document are `Access.READ` routes (behind the API token with ``protect_reads``); the assets
are public JavaScript and CSS, and stay open.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from api.auth import Access, ApiAuth

__all__ = ["ASSETS", "DOCS_URL", "OPENAPI_URL", "add_docs_routes"]

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
OPENAPI_URL = "/openapi.json"
ASSETS = "/docs-assets"
_OAUTH2_REDIRECT = "/docs/oauth2-redirect"
_STATIC = Path(fastapi_offline.__file__).parent / "static"


def add_docs_routes(app: FastAPI, auth: ApiAuth) -> None:
    """The documentation routes of an app built with ``docs_url``, ``redoc_url`` and ``openapi_url`` None."""
    read = [auth.dependency(Access.READ)]
    app.mount(ASSETS, StaticFiles(directory=_STATIC), name="docs-assets")

    @app.get(OPENAPI_URL, dependencies=read, include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get(DOCS_URL, dependencies=read, include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=OPENAPI_URL,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon.png",
            oauth2_redirect_url=_OAUTH2_REDIRECT,
            # Swagger UI would otherwise send the document to validator.swagger.io for its badge.
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get(_OAUTH2_REDIRECT, include_in_schema=False)
    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(REDOC_URL, dependencies=read, include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=OPENAPI_URL,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS}/favicon.png",
            with_google_fonts=False,
        )
