"""The router's HTTP app: the OpenAI API proxied, plus its own health, metrics and admin.

Routes:

- ``/v1/*`` (any method): forwarded by ``Proxy`` to a replica chosen by the policy.
- ``GET /health``: the router process is alive. ``GET /ready``: at least one
  replica can take traffic (else 503 with Retry-After).
- ``GET /metrics``: the ``ember_router_*`` metrics in Prometheus text format.
- ``GET /``: the chat page (``ember.webchat``), the same as a replica's; its
  API calls are relative, so they come back here and are routed.
- ``GET / POST / DELETE /admin/upstreams``: list, add, remove replicas at run
  time. With ``admin_key`` set they need ``Authorization: Bearer <key>`` or
  ``X-Admin-Key: <key>``; without one they answer loopback clients only.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ember import webchat
from ember.router.config import RouterConfig, normalize_upstream_url
from ember.router.errors import AUTHENTICATION, INVALID_REQUEST, NOT_FOUND, SERVER_ERROR, error_response
from ember.router.service import RouterService


class RouterApp(Starlette):
    """Starlette for the router's own endpoints; ``/v1/*`` goes to the proxy directly.

    The proxy answers its own errors and every chunk of a stream passes through
    ``send``: Starlette's error and exception middleware would wrap each of those
    sends (about a tenth of the router's CPU per streamed request, by py-spy)
    to add nothing the proxy does not already do.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            await self.state.router.proxy(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_router_app(
    config: RouterConfig,
    *,
    clock: Callable[[], float] = time.monotonic,
    transport: httpx.AsyncBaseTransport | None = None,
) -> RouterApp:
    """Build the router app. Its ``RouterService`` is ``app.state.router``.

    ``clock`` drives breakers and deadlines; ``transport`` replaces the network
    under the upstream client (tests). Probing starts with the app's lifespan.
    """
    service = RouterService(config, clock=clock, transport=transport)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        available = service.replicas.available_count()
        if available == 0:
            return error_response(
                503,
                "No upstream replica is ready.",
                type=SERVER_ERROR,
                code="no_upstream_available",
                retry_after_s=config.retry_after_s,
            )
        return JSONResponse({"status": "ready", "available_upstreams": available})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def upstreams(request: Request) -> Response:
        denied = _check_admin(request, config.admin_key)
        if denied is not None:
            return denied
        if request.method == "GET":
            return _upstreams_listing(service)
        try:
            url = normalize_upstream_url(await _admin_url(request))
        except ValueError as exc:  # RouterConfigError is one
            return error_response(400, str(exc), type=INVALID_REQUEST, param="url", code="invalid_url")
        if request.method == "POST":
            replica, added = service.add_upstream(url)
            if added:
                await service.probe_one(replica)  # answer with its real state
            return JSONResponse(replica.describe(), status_code=201 if added else 200)
        if not service.remove_upstream(url):
            return error_response(404, f"Upstream {url} is not configured.", type=NOT_FOUND, code="unknown_upstream")
        return JSONResponse({"removed": url})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/admin/upstreams", upstreams, methods=["GET", "POST", "DELETE"]),
        *webchat.routes(),
    ]
    app = RouterApp(routes=routes, lifespan=lifespan)
    app.state.router = service
    return app


def _upstreams_listing(service: RouterService) -> Response:
    return JSONResponse({"policy": service.config.policy, "upstreams": [replica.describe() for replica in service.replicas]})


async def _admin_url(request: Request) -> str:
    """The ``url`` of an admin call: from the JSON body, or the query string (DELETE)."""
    url = request.query_params.get("url")
    if url is not None:
        return url
    try:
        payload = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f'Body must be JSON like {{"url": "http://host:port"}}: {exc}') from exc
    if not isinstance(payload, dict) or not isinstance(payload.get("url"), str):
        raise ValueError('Body must be JSON like {"url": "http://host:port"}.')
    return payload["url"]


def _check_admin(request: Request, admin_key: str | None) -> Response | None:
    """None when the caller may use /admin, else the error to answer."""
    if admin_key is None:
        host = request.client.host if request.client else ""
        if _is_loopback(host):
            return None
        message = "Admin endpoints answer loopback clients only unless --admin-key is set."
        return error_response(403, message, type=AUTHENTICATION, code="admin_forbidden")
    given = request.headers.get("x-admin-key")
    if given is None:
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else ""
    if hmac.compare_digest(given.encode(), admin_key.encode()):
        return None
    return error_response(401, "Missing or wrong admin key.", type=AUTHENTICATION, code="invalid_admin_key")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
