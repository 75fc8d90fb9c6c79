"""ember.client.failover: URL preference and cool-down (fake clock), then failover end to end."""

from __future__ import annotations

import time

import pytest
from client_fake_server import Reply, closed_port_url

from ember.client import AsyncClient, Client, RetryPolicy, ServerError
from ember.client.failover import Endpoints

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pick_prefers_the_first_available_url() -> None:
    clock = FakeClock()
    endpoints = Endpoints(["http://a/v1/", "http://b/v1", "http://c/v1"], cooldown_s=10, clock=clock)
    assert endpoints.base_urls == ("http://a/v1", "http://b/v1", "http://c/v1")  # trailing slash dropped
    assert endpoints.pick() == "http://a/v1"
    endpoints.mark_failed("http://a/v1")
    assert endpoints.pick() == "http://b/v1"
    assert not endpoints.is_available("http://a/v1")
    assert endpoints.can_fail_over_from("http://b/v1")


def test_a_failed_url_comes_back_after_its_cooldown() -> None:
    clock = FakeClock()
    endpoints = Endpoints(["http://a/v1", "http://b/v1"], cooldown_s=10, clock=clock)
    endpoints.mark_failed("http://a/v1")
    clock.now += 9.9
    assert endpoints.pick() == "http://b/v1"
    clock.now += 0.2
    assert endpoints.pick() == "http://a/v1"


def test_mark_ok_ends_a_cooldown_early() -> None:
    endpoints = Endpoints(["http://a/v1", "http://b/v1"], cooldown_s=10, clock=FakeClock())
    endpoints.mark_failed("http://a/v1")
    endpoints.mark_ok("http://a/v1")
    assert endpoints.pick() == "http://a/v1"


def test_when_all_cool_down_the_first_to_recover_is_picked() -> None:
    clock = FakeClock()
    endpoints = Endpoints(["http://a/v1", "http://b/v1"], cooldown_s=10, clock=clock)
    endpoints.mark_failed("http://a/v1")
    clock.now += 1
    endpoints.mark_failed("http://b/v1")
    assert endpoints.pick() == "http://a/v1"
    assert not endpoints.can_fail_over_from("http://a/v1")


def test_a_single_url_never_cools_down() -> None:
    endpoints = Endpoints(["http://a/v1"], cooldown_s=10, clock=FakeClock())
    endpoints.mark_failed("http://a/v1")
    assert endpoints.is_available("http://a/v1")


def test_bad_configurations_are_rejected() -> None:
    with pytest.raises(ValueError):
        Endpoints([])
    with pytest.raises(ValueError):
        Endpoints(["http://a/v1", "http://a/v1/"])
    with pytest.raises(ValueError):
        Endpoints(["http://a/v1"], cooldown_s=-1)


SLOW_BACKOFF = RetryPolicy(initial_backoff_s=5.0)  # any backoff sleep would blow the time asserts


def test_503_fails_over_to_the_next_url_at_once_and_cools_down(serve) -> None:
    primary, backup = serve(), serve()
    primary.app.default = Reply(status=503, json={"error": {"message": "overloaded", "type": "server_error"}})
    with Client(base_urls=[primary.url, backup.url], retry=SLOW_BACKOFF, failover_cooldown_s=0.5) as client:
        started = time.monotonic()
        result = client.chat("hi")
        assert time.monotonic() - started < 2.0  # no backoff when another URL is available
        assert (result.base_url, result.attempts, result.text) == (backup.url, 2, "Hello world")
        assert len(primary.app.completions) == 1

        # While the primary cools down, calls go straight to the backup.
        assert client.chat("again").attempts == 1
        assert len(primary.app.completions) == 1

        # After the cool-down the primary is tried again, and now it answers.
        primary.app.default = Reply()
        time.sleep(0.6)
        result = client.chat("later")
        assert (result.base_url, result.attempts) == (primary.url, 1)


def test_connection_refused_fails_over(serve) -> None:
    backup = serve()
    dead_url = closed_port_url()
    with Client(base_urls=[dead_url, backup.url], retry=SLOW_BACKOFF) as client:
        result = client.chat("hi")
    assert (result.base_url, result.attempts) == (backup.url, 2)


def test_other_5xx_statuses_retry_the_same_url(serve) -> None:
    primary, backup = serve(), serve()
    primary.app.script = [Reply(status=500, json={"error": {"message": "boom"}})]
    with Client(base_urls=[primary.url, backup.url], retry=RetryPolicy(initial_backoff_s=0.01)) as client:
        result = client.chat("hi")
    assert (result.base_url, result.attempts) == (primary.url, 2)
    assert backup.app.completions == []


@pytest.mark.asyncio
async def test_every_url_failing_ends_in_the_last_error_with_all_attempts(serve) -> None:
    first, second = serve(), serve()
    for server in (first, second):
        server.app.default = Reply(status=503, json={"error": {"message": f"down {server.port}"}})
    policy = RetryPolicy(max_retries=3, initial_backoff_s=0.01)
    async with AsyncClient(base_urls=[first.url, second.url], retry=policy) as client:
        with pytest.raises(ServerError) as caught:
            await client.chat("hi")
    assert caught.value.attempts == 4
    assert caught.value.status_code == 503
    assert len(first.app.completions) + len(second.app.completions) == 4
    assert len(first.app.completions) >= 1 and len(second.app.completions) >= 1
