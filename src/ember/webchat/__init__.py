"""The chat page at ``/``, for ``ember serve`` and ``ember route`` alike.

The page is plain HTML, CSS and ES modules shipped inside the package
(``webchat/static``): no build step, no CDN, nothing fetched at run time, so
it works offline. It talks to the server only through the public
``/v1/chat/completions`` API with relative URLs, which is why the router can
serve the very same files: the page's calls then go through the router.

Only the files named in ``ASSETS`` are served (no directory walking, so no
path traversal to think about). The page carries a Content-Security-Policy
that allows scripts, styles and connections to this origin only: model output
is rendered as text nodes (``markdown.js``), and even a renderer bug could
neither run an inline script nor send a conversation elsewhere.
"""

from __future__ import annotations

import functools
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

ASSET_PREFIX = "/webchat/"

# The files under static/ that the page loads, with their media types.
ASSETS = {
    "chat.js": "text/javascript; charset=utf-8",
    "icon.svg": "image/svg+xml",
    "markdown.js": "text/javascript; charset=utf-8",
    "sse.js": "text/javascript; charset=utf-8",
    "stats.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}

_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# no-cache: revalidate, so a page served by a newer Ember never runs with older scripts.
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


@functools.cache
def _read(name: str) -> bytes:
    return (files(__package__) / "static" / name).read_bytes()


async def page(request: Request) -> Response:
    """``GET /``: the chat page."""
    return Response(_read("index.html"), media_type="text/html; charset=utf-8", headers={**_HEADERS, "Content-Security-Policy": _CSP})


async def asset(request: Request) -> Response:
    """``GET /webchat/{name}``: one of the page's scripts or its style sheet."""
    name = request.path_params["name"]
    media_type = ASSETS.get(name)
    if media_type is None:
        error = {"message": f"No such file: {ASSET_PREFIX}{name}", "type": "not_found_error", "param": None, "code": "not_found"}
        return JSONResponse({"error": error}, status_code=404)
    return Response(_read(name), media_type=media_type, headers=_HEADERS)


def routes() -> list[Route]:
    """The page's routes, to add to a Starlette or FastAPI app (kept out of the OpenAPI schema)."""
    return [
        Route("/", page, methods=["GET"], include_in_schema=False),
        Route(ASSET_PREFIX + "{name}", asset, methods=["GET"], include_in_schema=False),
    ]


def is_page_path(path: str) -> bool:
    """Whether ``path`` is the page or one of its files: public, whatever the API key."""
    return path == "/" or path.startswith(ASSET_PREFIX)
