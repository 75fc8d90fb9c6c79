"""Fixtures for client tests: fake OpenAI servers on real sockets, started and stopped per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from client_fake_server import FakeOpenAI, RunningServer


@pytest.fixture
def serve() -> Iterator[Callable[..., RunningServer]]:
    """Start fake servers on demand (``serve()`` or ``serve(http2=True)``); all stop after the test."""
    servers: list[RunningServer] = []

    def start(*, http2: bool = False) -> RunningServer:
        server = RunningServer(FakeOpenAI(), http2=http2)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(serve: Callable[..., RunningServer]) -> RunningServer:
    """One HTTP/1.1 fake server (uvicorn)."""
    return serve()
