"""ember.client.errors: which class each failure raises, and the fields it carries."""

from __future__ import annotations

import pytest
from client_fake_server import Reply

from ember.client import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    Client,
    ConnectTimeout,
    DeadlineExceeded,
    EmberClientError,
    FirstTokenTimeout,
    RateLimitedError,
    RetryPolicy,
    ServerError,
    StallTimeout,
    StreamError,
)
from ember.client.errors import parse_error_body, status_error_class
from ember.errors import EmberError

pytestmark = pytest.mark.timeout(30)

NO_RETRY = RetryPolicy(max_retries=0)


def openai_error(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def test_the_hierarchy() -> None:
    for cls in (APIConnectionError, APITimeoutError, APIStatusError, StreamError):
        assert issubclass(cls, EmberClientError)
    for cls in (ConnectTimeout, FirstTokenTimeout, StallTimeout, DeadlineExceeded):
        assert issubclass(cls, APITimeoutError)
    for cls in (BadRequestError, AuthenticationError, RateLimitedError, ServerError):
        assert issubclass(cls, APIStatusError)
    assert issubclass(EmberClientError, EmberError)  # one `except EmberError` catches all of Ember


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, BadRequestError), (404, BadRequestError), (409, BadRequestError), (413, BadRequestError),
        (422, BadRequestError), (401, AuthenticationError), (403, AuthenticationError),
        (429, RateLimitedError), (408, APIStatusError), (500, ServerError), (503, ServerError),
        (504, ServerError), (302, APIStatusError),
    ],
)  # fmt: skip
def test_status_to_class(status: int, expected: type) -> None:
    assert status_error_class(status) is expected


def test_a_non_json_error_body_is_wrapped() -> None:
    assert parse_error_body(b"upstream went away\n") == {
        "error": {"message": "upstream went away", "type": None, "param": None, "code": None}
    }


def test_authentication_error_carries_status_body_request_id_and_attempts(server) -> None:
    body = openai_error("Incorrect API key provided", "invalid_request_error", code="invalid_api_key")
    server.app.default = Reply(status=401, json=body, headers={"X-Request-ID": "srv-42"})
    with Client(server.url, api_key="wrong") as client:
        with pytest.raises(AuthenticationError) as caught:
            client.chat("hi")
    error = caught.value
    assert (error.status_code, error.request_id, error.attempts, error.retries) == (401, "srv-42", 1, 0)
    assert error.body == body
    assert (error.message, error.error_type, error.code, error.param) == (
        "Incorrect API key provided", "invalid_request_error", "invalid_api_key", None,
    )  # fmt: skip
    assert error.base_url == server.url
    assert "status=401" in str(error) and "srv-42" in str(error)


def test_validation_error_names_the_param(server) -> None:
    body = openai_error("temperature must be <= 2", "invalid_request_error", param="temperature")
    server.app.default = Reply(status=422, json=body)
    with Client(server.url) as client:
        with pytest.raises(BadRequestError) as caught:
            client.chat("hi", temperature=9)
    assert caught.value.param == "temperature"
    assert caught.value.status_code == 422
    # Without a server id the client's own X-Request-ID is reported (the fake echoes it).
    assert caught.value.request_id == server.app.completions[0].headers["x-request-id"]


def test_exhausted_429_reports_every_attempt_and_the_hint(server) -> None:
    body = openai_error("queue full", "rate_limit_error", code="rate_limited")
    server.app.default = Reply(status=429, json=body, headers={"retry-after-ms": "10"})
    with Client(server.url, retry=RetryPolicy(max_retries=2)) as client:
        with pytest.raises(RateLimitedError) as caught:
            client.chat("hi")
    assert (caught.value.attempts, caught.value.retry_after_s, caught.value.code) == (3, 0.01, "rate_limited")


def test_server_error_with_plain_text_body(server) -> None:
    server.app.default = Reply(status=500, json="internal failure")
    with Client(server.url, retry=NO_RETRY) as client:
        with pytest.raises(ServerError) as caught:
            client.chat("hi")
    assert caught.value.status_code == 500
    assert caught.value.body == "internal failure"  # valid JSON, just not an object
    assert caught.value.message == "HTTP 500"


def test_error_chunk_mid_stream_raises_stream_error_and_is_not_retried(server) -> None:
    error = {"message": "engine died", "type": "server_error", "param": None, "code": "engine_dead"}
    server.app.default = Reply(deltas=["Hi"], error_chunk=error)
    received: list[str] = []
    with Client(server.url, retry=RetryPolicy(initial_backoff_s=0.01)) as client:
        with pytest.raises(StreamError) as caught:
            for delta in client.stream_chat("hi"):
                received.append(delta)
        with pytest.raises(StreamError):
            client.chat("hi")  # not retried even when nothing was handed out: the server said no
    assert received == ["Hi"]
    assert caught.value.body == {"error": error}
    assert (caught.value.message, caught.value.code, caught.value.status_code) == ("engine died", "engine_dead", None)
    assert len(server.app.completions) == 2


def test_connection_error_fields(server) -> None:
    server.app.default = Reply(drop_after=0)
    with Client(server.url, retry=RetryPolicy(max_retries=1, initial_backoff_s=0.01)) as client:
        with pytest.raises(APIConnectionError) as caught:
            client.chat("hi", request_id="mine-1")
    assert (caught.value.attempts, caught.value.status_code, caught.value.request_id) == (2, None, "mine-1")
