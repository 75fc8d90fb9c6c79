"""Unit tests of ember.client.sse: event-stream framing, whatever the byte boundaries."""

from __future__ import annotations

import pytest

from ember.client.sse import ServerSentEvent, SSEDecoder

pytestmark = pytest.mark.timeout(10)

STREAM = (
    b": keep-alive comment\n"
    b"data: {\"a\": 1}\n\n"
    b"event: update\r\nid: 7\r\ndata: line one\r\ndata:line two\r\n\r\n"
    b"data: caf\xc3\xa9 \xe2\x9c\x93\r\r"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    ServerSentEvent('{"a": 1}'),
    ServerSentEvent("line one\nline two", event="update", id="7"),
    ServerSentEvent("caf\u00e9 \u2713", id="7"),  # the last event id persists, as the spec says
    ServerSentEvent("[DONE]", id="7"),
]


def feed_in_pieces(data: bytes, size: int) -> list[ServerSentEvent]:
    decoder = SSEDecoder()
    events: list[ServerSentEvent] = []
    for start in range(0, len(data), size):
        events += decoder.feed(data[start : start + size])
    return events


def test_whole_stream_at_once() -> None:
    assert SSEDecoder().feed(STREAM) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 13])
def test_any_split_gives_the_same_events(size: int) -> None:
    # Size 1 splits every CRLF pair and every multi-byte UTF-8 character.
    assert feed_in_pieces(STREAM, size) == EXPECTED


def test_crlf_split_across_pieces_is_not_an_empty_line() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: x\r") == []
    assert decoder.feed(b"\ndata: y\r") == []  # the LF completes CRLF; no dispatch yet
    assert decoder.feed(b"\n\r\n") == [ServerSentEvent("x\ny")]


def test_an_event_is_dispatched_only_by_a_blank_line() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: partial") == []
    assert decoder.feed(b"\n") == []
    assert decoder.feed(b"\n") == [ServerSentEvent("partial")]


def test_comments_and_unknown_fields_dispatch_nothing() -> None:
    assert SSEDecoder().feed(b": ping\n\nretry: 100\nfoo: bar\n\n") == []


def test_empty_data_field_is_an_event() -> None:
    assert SSEDecoder().feed(b"data\n\ndata:\n\n") == [ServerSentEvent(""), ServerSentEvent("")]


def test_only_one_leading_space_is_dropped() -> None:
    assert SSEDecoder().feed(b"data:   indented\n\n") == [ServerSentEvent("  indented")]
