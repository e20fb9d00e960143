"""The chat page at `/`: plain HTML + JavaScript from `llmc/serve/static/` (no build step, no CDN), streaming
answers from /v1/chat/completions. Served as files of the package; the page calls the API with relative URLs."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response

STATIC = Path(__file__).with_name("static")
_TYPES = {"chat.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8"}


def install(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return FileResponse(STATIC / "chat.html", media_type="text/html; charset=utf-8",
                            headers={"Cache-Control": "no-cache"})

    for name, media_type in _TYPES.items():
        _static(app, name, media_type)


def _static(app: FastAPI, name: str, media_type: str) -> None:
    async def asset() -> Response:
        return FileResponse(STATIC / name, media_type=media_type, headers={"Cache-Control": "no-cache"})

    app.add_api_route(f"/static/{name}", asset, methods=["GET"], include_in_schema=False)
