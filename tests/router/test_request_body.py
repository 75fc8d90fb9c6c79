"""The ASGI body reader shared by ``ember route`` and the Ray ingress: whole bodies, the limit, disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import pytest

from ember.router.request_body import BodyTooLarge, ClientGone, read_body


def receiver(*messages: MutableMapping[str, Any]):
    """An ASGI ``receive`` that hands out ``messages`` in order (then fails: the reader must stop before)."""
    queue = list(messages)

    async def receive() -> MutableMapping[str, Any]:
        return queue.pop(0)

    return receive


def chunk(body: bytes, more: bool) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


def test_a_body_in_one_message_comes_back_as_it_is() -> None:
    body = b'{"messages": []}'
    assert asyncio.run(read_body(receiver(chunk(body, False)), limit=100)) is body  # no copy


def test_a_body_in_several_messages_is_joined() -> None:
    receive = receiver(chunk(b"ab", True), chunk(b"", True), chunk(b"cd", False))
    assert asyncio.run(read_body(receive, limit=4)) == b"abcd"


def test_an_empty_request_has_an_empty_body() -> None:
    assert asyncio.run(read_body(receiver({"type": "http.request"}), limit=0)) == b""


def test_one_byte_over_the_limit_stops_reading() -> None:
    with pytest.raises(BodyTooLarge):
        # Nothing is asked for after the message that passes the limit (a third receive would fail).
        asyncio.run(read_body(receiver(chunk(b"abc", True), chunk(b"de", True)), limit=4))


def test_a_disconnect_before_the_end_is_a_client_gone() -> None:
    with pytest.raises(ClientGone):
        asyncio.run(read_body(receiver(chunk(b"ab", True), {"type": "http.disconnect"}), limit=100))
