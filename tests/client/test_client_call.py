"""ember.client.call end to end: retries, retry hints, time limits and the no-retry-after-first-byte rule."""

from __future__ import annotations

import time

import pytest
from client_fake_server import Reply

from ember.client import (
    APIConnectionError,
    AsyncClient,
    BadRequestError,
    Client,
    DeadlineExceeded,
    FirstTokenTimeout,
    RateLimitedError,
    RetryPolicy,
    ServerError,
    StallTimeout,
    Timeouts,
)

pytestmark = pytest.mark.timeout(30)

# A backoff this long would show in every elapsed-time assert, so passing tests prove it was not used.
SLOW_BACKOFF = RetryPolicy(initial_backoff_s=5.0)
FAST_BACKOFF = RetryPolicy(initial_backoff_s=0.05)
RATE_LIMITED = {"error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": "rate_limited"}}


def test_429_waits_out_retry_after_seconds(server) -> None:
    server.app.script = [Reply(status=429, json=RATE_LIMITED, headers={"Retry-After": "1"})]
    with Client(server.url, retry=SLOW_BACKOFF) as client:
        started = time.monotonic()
        result = client.chat("hi")
        elapsed = time.monotonic() - started
    assert (result.attempts, result.retries, result.text) == (2, 1, "Hello world")
    first, second = server.app.completions
    assert second.at - first.at >= 1.0
    assert 1.0 <= elapsed < 3.0


def test_retry_after_ms_wins_over_the_backoff(server) -> None:
    server.app.script = [Reply(status=429, json=RATE_LIMITED, headers={"retry-after-ms": "300"})] * 2
    with Client(server.url, retry=SLOW_BACKOFF) as client:
        started = time.monotonic()
        result = client.chat("hi")
        elapsed = time.monotonic() - started
    assert result.attempts == 3
    assert 0.6 <= elapsed < 2.5


@pytest.mark.parametrize("status", [408, 500, 502, 503, 504])
def test_retryable_statuses_are_retried(server, status: int) -> None:
    server.app.script = [Reply(status=status, json={"error": {"message": "transient"}})]
    with Client(server.url, retry=FAST_BACKOFF) as client:
        assert client.chat("hi").attempts == 2


def test_retries_stop_after_max_retries(server) -> None:
    server.app.default = Reply(status=502, json={"error": {"message": "bad gateway"}})
    with Client(server.url, retry=RetryPolicy(max_retries=2, initial_backoff_s=0.01)) as client:
        with pytest.raises(ServerError) as caught:
            client.chat("hi")
    assert caught.value.attempts == 3 and caught.value.retries == 2
    assert len(server.app.completions) == 3


def test_x_should_retry_true_retries_a_400(server) -> None:
    server.app.script = [Reply(status=400, json={"error": {"message": "try again"}}, headers={"x-should-retry": "true"})]
    with Client(server.url, retry=FAST_BACKOFF) as client:
        assert client.chat("hi").attempts == 2


def test_x_should_retry_false_stops_a_503(server) -> None:
    server.app.default = Reply(status=503, json={"error": {"message": "no"}}, headers={"x-should-retry": "false"})
    with Client(server.url, retry=FAST_BACKOFF) as client:
        with pytest.raises(ServerError) as caught:
            client.chat("hi")
    assert caught.value.attempts == 1
    assert caught.value.should_retry is False
    assert len(server.app.completions) == 1


def test_a_400_is_not_retried(server) -> None:
    server.app.default = Reply(status=400, json={"error": {"message": "bad"}})
    with Client(server.url, retry=FAST_BACKOFF) as client:
        with pytest.raises(BadRequestError):
            client.chat("hi")
    assert len(server.app.completions) == 1


def test_no_retry_after_the_first_delta_reached_the_caller(server) -> None:
    server.app.default = Reply(deltas=["Hel", "lo"], drop_after=1)
    received: list[str] = []
    with Client(server.url, retry=FAST_BACKOFF) as client:
        with pytest.raises(APIConnectionError) as caught:
            with client.stream_chat("hi") as stream:
                for delta in stream:
                    received.append(delta)
    assert received == ["Hel"]
    assert caught.value.attempts == 1
    assert len(server.app.completions) == 1


def test_a_stream_that_broke_before_any_text_is_retried(server) -> None:
    # The role chunk carries no text, so nothing reached the caller yet.
    server.app.script = [Reply(deltas=["never"], drop_after=0)]
    with Client(server.url, retry=FAST_BACKOFF) as client:
        with client.stream_chat("hi") as stream:
            assert list(stream) == ["Hello", " world"]
    assert stream.result.attempts == 2
    assert len(server.app.completions) == 2


def test_chat_retries_a_stream_broken_midway_because_nothing_was_handed_out(server) -> None:
    server.app.script = [Reply(deltas=["partial", "x"], drop_after=1)]
    with Client(server.url, retry=FAST_BACKOFF) as client:
        result = client.chat("hi")
    assert (result.text, result.attempts) == ("Hello world", 2)  # the partial text was discarded


def test_a_stream_closed_without_done_or_finish_reason_is_an_error(server) -> None:
    server.app.default = Reply(finish_reason=None, done=False)
    with Client(server.url, retry=RetryPolicy(max_retries=0)) as client:
        with pytest.raises(APIConnectionError, match="before it was complete"):
            client.chat("hi")


def test_a_stall_mid_stream_raises_stall_timeout(server) -> None:
    server.app.default = Reply(deltas=["one", "two"], stall_after=1)
    received: list[str] = []
    with Client(server.url, timeouts=Timeouts(stall_s=0.3)) as client:
        started = time.monotonic()
        with pytest.raises(StallTimeout) as caught:
            for delta in client.stream_chat("hi"):
                received.append(delta)
    assert received == ["one"]
    assert 0.3 <= time.monotonic() - started < 2.0
    assert caught.value.attempts == 1  # timeouts are not retried: the server may still be generating


def test_slow_but_steady_tokens_do_not_stall(server) -> None:
    server.app.default = Reply(deltas=["a", "b", "c", "d"], delta_delay_s=0.15)
    with Client(server.url, timeouts=Timeouts(stall_s=0.5)) as client:
        assert client.chat("hi").text == "abcd"


def test_no_first_token_in_time_raises_first_token_timeout(server) -> None:
    server.app.default = Reply(header_delay_s=5.0)
    with Client(server.url, timeouts=Timeouts(first_token_s=0.3)) as client:
        started = time.monotonic()
        with pytest.raises(FirstTokenTimeout):
            client.chat("hi")
    assert 0.3 <= time.monotonic() - started < 2.0


def test_headers_without_a_first_token_still_hit_the_first_token_limit(server) -> None:
    # The response starts (role chunk) but no text follows: the stall limit must not apply yet.
    server.app.default = Reply(deltas=["late"], stall_after=0)
    with Client(server.url, timeouts=Timeouts(first_token_s=0.3, stall_s=10.0)) as client:
        with pytest.raises(FirstTokenTimeout):
            client.chat("hi")


def test_the_total_deadline_is_respected_and_sent_to_the_server(server) -> None:
    server.app.default = Reply(header_delay_s=5.0)
    with Client(server.url, timeouts=Timeouts(first_token_s=30.0)) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as caught:
            client.chat("hi", deadline_s=0.5)
        elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 1.5
    assert caught.value.attempts == 1
    sent = float(server.app.completions[0].headers["x-request-timeout"])
    assert 0.3 < sent <= 0.5


def test_the_deadline_budget_shrinks_across_retries(server) -> None:
    server.app.script = [Reply(status=503, json={"error": {"message": "busy"}}, headers={"retry-after-ms": "300"})]
    with Client(server.url, timeouts=Timeouts(total_s=3.0)) as client:
        result = client.chat("hi")
    first, second = (float(seen.headers["x-request-timeout"]) for seen in server.app.completions)
    assert result.attempts == 2
    assert 2.8 < first <= 3.0
    assert first - second >= 0.3


def test_a_retry_wait_past_the_deadline_is_not_started(server) -> None:
    server.app.default = Reply(status=429, json=RATE_LIMITED, headers={"Retry-After": "5"})
    with Client(server.url) as client:
        started = time.monotonic()
        with pytest.raises(RateLimitedError) as caught:  # not DeadlineExceeded: it did not sleep into the deadline
            client.chat("hi", deadline_s=3.0)
    assert time.monotonic() - started < 2.0
    assert caught.value.retry_after_s == 5.0
    assert caught.value.attempts == 1


@pytest.mark.asyncio
async def test_async_stream_is_cancelled_cleanly_midway(server) -> None:
    server.app.default = Reply(deltas=["a", "b", "c"], delta_delay_s=0.05)
    async with AsyncClient(server.url) as client:
        async with client.stream_chat("hi") as stream:
            async for delta in stream:
                assert delta == "a"
                break
        with pytest.raises(RuntimeError, match="not finished"):
            stream.result
        assert stream.text == "a"
        # The pool still serves the next call after the abandoned stream.
        assert (await client.chat("again")).text == "abc"
