"""EmberIngress: the application's HTTP entry point behind Ray Serve's proxy.

A thin relay, holding no engine: for each request it reads the body, derives
the session key exactly as ``ember route`` does (``router.session_key``:
``X-Session-ID``, the ``/v1/sessions/{id}`` path, the body's ``session_id``
or ``user``, the conversation's opening) and calls the ``EmberReplica``
deployment with it as the handle's ``session_id``. The replicas' request
router (``SessionAffinityRouter``) picks the replica from that key.

Failover before the first byte: a replica that dies (or cannot be reached)
before it has sent anything costs the client nothing; the call is made again,
up to ``RayConfig.max_attempts`` times, and the router no longer offers the
dead replica. A replica that dies mid-stream ends the stream the way
``ember route`` does: an error event, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, cast

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from ember.ray.config import RayConfig
from ember.ray.exchange import HttpExchange, Message, error_messages
from ember.router.errors import INVALID_REQUEST, SERVER_ERROR, error_body, sse_error_events
from ember.router.request_body import BodyTooLarge, ClientGone, read_body
from ember.router.session_key import MalformedBodyError, request_key

log = logging.getLogger("ember.ray")

Scope = dict[str, Any]


class SessionRelay:
    """The ingress's ASGI app (see module docstring)."""

    def __init__(self, replicas: DeploymentHandle, config: RayConfig, max_body_bytes: int) -> None:
        self._replicas = replicas
        self._config = config
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # no websockets in the OpenAI API
        try:
            body = await read_body(receive, self._max_body_bytes)
        except ClientGone:
            return
        except BodyTooLarge:
            await _send_all(
                send, _error(413, f"Request body is larger than {self._max_body_bytes} bytes.", INVALID_REQUEST, "body_too_large")
            )
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        session_header = next((v.decode("latin-1") for k, v in headers if k == b"x-session-id"), None) or None
        content_type = next((v for k, v in headers if k == b"content-type"), None)
        try:
            key = request_key(
                session_header,
                scope["path"],
                scope["method"],
                body,
                may_be_json=content_type is None or b"json" in content_type.lower(),
                prompt_chars=self._config.session_prompt_chars,
            )
        except MalformedBodyError as exc:
            await _send_all(send, _error(400, str(exc), INVALID_REQUEST, "invalid_json"))
            return
        client = scope.get("client")
        exchange = HttpExchange(
            method=scope["method"],
            path=scope["path"],
            query_string=scope.get("query_string", b""),
            headers=tuple(headers),
            body=body,
            client=tuple(client) if client else None,
            scheme=scope.get("scheme", "http"),
            http_version=scope.get("http_version", "1.1"),
        )
        await self._relay(exchange, key, send)

    async def _relay(self, exchange: HttpExchange, key: str | None, send: Any) -> None:
        handle = self._replicas.options(stream=True, session_id=key or "", method_name="handle_http")
        for attempt in range(1, self._config.max_attempts + 1):
            stream = cast(DeploymentResponseGenerator[Any], handle.remote(exchange))  # options(stream=True): a generator
            try:
                first = await stream.__anext__()
            except RayActorError as exc:
                log.warning(
                    "%s %s: replica gone before the first byte (attempt %d): %s",
                    exchange.method,
                    exchange.path,
                    attempt,
                    type(exc).__name__,
                )
                continue
            except BaseException:
                stream.cancel()
                raise
            await self._forward(stream, first, send)
            return
        await _send_all(send, _error(503, "No replica could take the request; retry shortly.", SERVER_ERROR, "no_replica", retry_after_s=1))

    async def _forward(self, stream: Any, first: list[Message], send: Any) -> None:
        """Relay the replica's messages; a replica lost midway ends the response cleanly."""
        is_sse = False
        finished = False
        try:
            batch = first
            while True:
                for message in batch:
                    if message["type"] == "http.response.start":
                        is_sse = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in message["headers"])
                        # Ray's proxy adds X-Request-ID to every response (the replica used the same id).
                        message = {**message, "headers": [(k, v) for k, v in message["headers"] if k != b"x-request-id"]}
                    elif not message.get("more_body", False):
                        finished = True
                    await send(message)
                try:
                    batch = await stream.__anext__()
                except StopAsyncIteration:
                    return
        except RayActorError as exc:
            if finished:
                return
            log.warning("replica lost mid-response: %s", type(exc).__name__)
            tail = sse_error_events("The replica serving this stream stopped.", "replica_lost") if is_sse else b""
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        except BaseException:
            stream.cancel()  # the client left: stop the generation on the replica
            raise


@serve.deployment(name="EmberIngress")
@serve.ingress()
class EmberIngress:
    """The ingress deployment: a ``SessionRelay`` in front of the ``EmberReplica`` deployment."""

    def __init__(self, replicas: DeploymentHandle, config: RayConfig, max_body_bytes: int) -> None:
        self._relay = SessionRelay(replicas, config, max_body_bytes)

    def __serve_build_asgi_app__(self) -> SessionRelay:
        return self._relay


def _error(status: int, message: str, type: str, code: str, retry_after_s: int | None = None) -> list[Message]:
    headers = [(b"retry-after", str(retry_after_s).encode())] if retry_after_s is not None else []
    return error_messages(status, json.dumps(error_body(message, type, code)).encode(), headers)


async def _send_all(send: Any, messages: list[Message]) -> None:
    for message in messages:
        await send(message)


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
