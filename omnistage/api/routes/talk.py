"""GET /talk: a page to talk to the pipeline through ``/v1/realtime`` from a browser.

Like the dashboard, the page is a static file with no data in it, so it is served
without ``--api-key``; the key guards what the page then asks for. A browser's
WebSocket cannot send an Authorization header, so with a key the page first trades it
for a short-lived client secret (``POST /v1/realtime/client_secrets``) and offers that
as the ``openai-insecure-api-key.<secret>`` subprotocol, as OpenAI's own browser
clients do.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from starlette.responses import Response

router = APIRouter()

# The page may talk to this origin only (``'self'`` covers ws: and wss: to it) and may
# not be framed. ``blob:`` scripts: its two AudioWorklet modules are loaded from Blob
# URLs, so that the page stays one file.
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline' blob:; style-src 'unsafe-inline'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
    # The page asks for the microphone itself, and nothing it embeds may.
    "Permissions-Policy": "microphone=(self), camera=(), geolocation=()",
}


@cache
def _page() -> bytes:
    return (resources.files("omnistage.api") / "static" / "talk.html").read_bytes()


@router.get("/talk", include_in_schema=False)
async def talk() -> Response:
    return Response(_page(), media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)
