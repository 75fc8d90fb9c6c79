"""Read an ASGI request body whole, under a size limit: one reader for ``ember route`` and the Ray ingress.

Both relay a request only once its body is complete: the session key may come
from the body, and a failed attempt is sent again, whole, to another replica.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class ClientGone(Exception):
    """The client disconnected before its body was read: there is no one to answer."""


class BodyTooLarge(Exception):
    """The body is larger than the limit (reading stopped at the first message past it)."""


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole body of an ASGI ``http`` request; ``BodyTooLarge`` past ``limit`` bytes, ``ClientGone`` on a disconnect."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        if not message.get("more_body", False):
            # The usual case, a body in one message, is returned without a copy.
            return b"".join((*parts, chunk)) if parts else chunk
        parts.append(chunk)
