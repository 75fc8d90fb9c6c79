"""One conversation, three transports: the SDK gets the same text over HTTP/1.1, HTTP/2 and gRPC, greedy and seeded."""

from __future__ import annotations

import pytest

from ember.client import Client
from server_process import ServerProcess
from transport_common import API_KEY

pytestmark = pytest.mark.timeout(180)

TURNS = ("Name three colors.", "Which of them is the warmest?")


SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 4242}}


def _conversation(base_url: str, transport: str, api_key: str | None, sampling: str) -> list[tuple[str, str | None, int | None]]:
    with Client(base_url, transport=transport, api_key=api_key) as client:
        assert client.transport == transport
        conversation = client.conversation("You are a concise assistant.")
        replies = []
        for turn in TURNS:
            result = conversation.send(turn, max_tokens=24, **SAMPLINGS[sampling])
            expected_version = {"http1": "HTTP/1.1", "http2": "HTTP/2", "grpc": "grpc"}[transport]
            assert result.http_version == expected_version
            replies.append((result.text, result.finish_reason, result.usage.completion_tokens if result.usage else None))
        return replies


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_the_same_conversation_gives_the_same_text_over_every_transport(grpc_server: ServerProcess, h2_server: ServerProcess, sampling: str) -> None:
    over_http1 = _conversation(grpc_server.url, "http1", API_KEY, sampling)  # uvicorn: the HTTP/1.1 path
    over_grpc = _conversation(grpc_server.grpc_url, "grpc", API_KEY, sampling)
    over_http2 = _conversation(h2_server.url, "http2", None, sampling)  # granian, h2c
    assert all(text.strip() for text, _, _ in over_http1)
    assert over_grpc == over_http1
    assert over_http2 == over_http1
