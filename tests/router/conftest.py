"""Fixtures for router tests: fake upstreams and routers on real sockets."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest
from router_fakes import FakeUpstream, ServerThread, stop_all

from ember.router import RouterConfig, create_router_app
from ember.router.service import RouterService

# Probing is off in spirit (30 s) unless a test asks for it, so what a test
# sees is caused by its own requests; the first probe still runs at startup.
TEST_CONFIG = RouterConfig(
    probe_interval_s=30.0,
    probe_timeout_s=0.5,
    connect_timeout_s=0.5,
    stall_timeout_s=2.0,
    request_timeout_s=10.0,
)


class FakeClock:
    """A monotonic clock that moves only when a test says so (thread-safe)."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


@dataclass
class RunningRouter:
    url: str
    service: RouterService
    http: httpx.Client
    server: ServerThread

    def upstream_state(self, url: str) -> dict[str, Any]:
        """The router's view of one upstream, via its admin endpoint."""
        listing = self.http.get("/admin/upstreams").json()["upstreams"]
        return next(u for u in listing if u["url"] == url)

    def chat(self, *, session: str | None = None, stream: bool = False, **extra: Any) -> httpx.Response:
        body: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **extra}
        if stream:
            body["stream"] = True
        headers = {"X-Session-ID": session} if session else {}
        return self.http.post("/v1/chat/completions", json=body, headers=headers)


@pytest.fixture(scope="session")
def upstream_pool() -> Iterator[list[FakeUpstream]]:
    fakes = [FakeUpstream(name) for name in ("a", "b", "c")]
    yield fakes
    stop_all([fake.server for fake in fakes])


@pytest.fixture
def upstreams(upstream_pool: list[FakeUpstream]) -> list[FakeUpstream]:
    """Three healthy fake upstreams named a, b, c, with empty request records."""
    for fake in upstream_pool:
        fake.reset()
    return upstream_pool


@pytest.fixture
def start_router() -> Iterator[Callable[..., RunningRouter]]:
    """Start a router on a real socket: ``start_router([urls], clock=None, **config overrides)``."""
    started: list[RunningRouter] = []

    def start(upstream_urls: list[str], clock: Callable[[], float] | None = None, **overrides: Any) -> RunningRouter:
        config = replace(TEST_CONFIG, upstreams=tuple(upstream_urls), **overrides)
        app = create_router_app(config, clock=clock) if clock else create_router_app(config)
        server = ServerThread(app, lifespan="on")
        router = RunningRouter(server.url, app.state.router, httpx.Client(base_url=server.url, timeout=10), server)
        started.append(router)
        return router

    yield start
    for router in started:
        router.http.close()
    stop_all([router.server for router in started])


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()
