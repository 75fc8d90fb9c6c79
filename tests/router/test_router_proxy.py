"""The proxy path through real sockets: streaming, headers, errors, failover, affinity."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from router_fakes import FakeUpstream, ServerThread, sse_events, wait_until

from ember.router import rendezvous_order


def session_homed_at(url: str, urls: list[str], prefix: str = "s") -> str:
    """A session id whose rendezvous home among ``urls`` is ``url``."""
    return next(f"{prefix}{i}" for i in range(10_000) if rendezvous_order(f"{prefix}{i}", urls)[0] == url)


def content_of(events: list) -> str:
    """The assistant text carried by decoded chat chunk events."""
    chunks = [e for e in events if isinstance(e, dict) and "choices" in e]
    return "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)


@pytest.mark.timeout(20)
def test_stream_is_relayed_chunk_by_chunk(upstreams, start_router) -> None:
    a = upstreams[0]
    a.chunk_delay_s = 0.15
    router = start_router([a.url])
    arrivals: list[tuple[float, int]] = []  # (time, upstream streams finished at that moment)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with router.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = []
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append((time.monotonic(), a.streams_finished))
            lines.append(line)
    events = sse_events(lines)
    assert content_of(events) == "Hello from a!" and events[-1] == "[DONE]"
    # The first token reached the client while the upstream was still generating...
    assert arrivals[0][1] == 0
    # ...and the tokens arrived spread out as they were made, not in one burst.
    gaps = [later[0] - earlier[0] for earlier, later in zip(arrivals, arrivals[1:4])]
    assert all(gap > 0.08 for gap in gaps), gaps


@pytest.mark.timeout(20)
def test_non_streaming_answer_passes_through(upstreams, start_router) -> None:
    router = start_router([upstreams[0].url])
    response = router.chat()
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "Hello from a!"
    completion = router.http.post("/v1/completions", json={"model": "m", "prompt": "Once"})
    assert completion.json()["choices"][0]["text"] == "Hello from a!"


@pytest.mark.timeout(20)
def test_upstream_connections_are_kept_alive_and_shared(upstreams, start_router) -> None:
    a = upstreams[0]
    router = start_router([a.url])
    for stream in (True, False, True, False, True):
        assert router.chat(stream=stream).status_code == 200
    with httpx.Client(base_url=router.url) as other_client:
        assert other_client.get("/v1/models").status_code == 200
    ports = {seen.peer_port for seen in a.requests}
    assert len(a.requests) == 6 and len(ports) == 1  # one connection for every client and request


@pytest.mark.timeout(20)
def test_headers_are_forwarded_both_ways(upstreams, start_router) -> None:
    a = upstreams[0]
    router = start_router([a.url])
    sent = {
        "X-Request-ID": "req-123",
        "X-Session-ID": "sess-9",
        "Authorization": "Bearer sk-test",
        "api-key": "azure-style-key",
        "X-Priority": "high",
        "Proxy-Authorization": "Basic hop-by-hop",
    }
    response = router.http.post("/v1/chat/completions", json={"model": "m", "messages": []}, headers=sent)
    assert response.status_code == 200
    seen = a.completions_seen()[0].headers
    assert seen["x-request-id"] == "req-123" and seen["x-session-id"] == "sess-9"
    assert seen["authorization"] == "Bearer sk-test" and seen["api-key"] == "azure-style-key"
    assert seen["x-priority"] == "high"
    assert "proxy-authorization" not in seen  # hop-by-hop headers stop at the router
    assert seen["host"] == f"127.0.0.1:{a.port}"
    assert response.headers["x-upstream"] == "a"
    assert response.headers["x-request-id"] == "req-123"
    assert response.headers["x-ember-upstream"] == a.url
    assert len(response.headers.get_list("date")) == 1 and len(response.headers.get_list("server")) == 1


@pytest.mark.timeout(20)
def test_the_serving_replica_can_be_hidden_from_clients(upstreams, start_router) -> None:
    a = upstreams[0]
    router = start_router([a.url], expose_upstream=False)
    for stream in (False, True):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        response = router.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200 and "x-ember-upstream" not in response.headers
        assert a.url not in response.text


@pytest.mark.timeout(20)
def test_router_assigns_a_request_id_when_the_client_has_none(upstreams, start_router) -> None:
    a = upstreams[0]
    router = start_router([a.url])
    response = router.chat()
    request_id = a.completions_seen()[0].headers["x-request-id"]
    assert len(request_id) == 32 and response.headers["x-request-id"] == request_id


@pytest.mark.timeout(20)
def test_router_replaces_a_request_id_that_is_not_a_reasonable_token(upstreams, start_router) -> None:
    a = upstreams[0]
    router = start_router([a.url])
    response = router.http.post("/v1/chat/completions", json={"model": "m", "messages": []}, headers={"X-Request-ID": "x" * 200})
    request_id = a.completions_seen()[0].headers["x-request-id"]
    assert len(request_id) == 32 and request_id != "x" * 200
    assert response.headers["x-request-id"] == request_id


@pytest.mark.timeout(20)
def test_malformed_json_is_a_400_and_never_reaches_an_upstream(upstreams, start_router) -> None:
    a = upstreams[0]
    router = start_router([a.url])
    response = router.http.post(
        "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert a.completions_seen() == []


@pytest.mark.timeout(20)
def test_without_a_need_to_parse_the_body_the_replicas_400_is_passed_on(upstreams, start_router) -> None:
    a = upstreams[0]
    router = start_router([a.url], policy="least-load", breaker_failures=1)
    headers = {"Content-Type": "application/json"}
    response = router.http.post("/v1/chat/completions", content=b"{not json", headers=headers)
    assert response.status_code == 400 and response.json()["error"]["message"] == "body is not JSON"
    assert router.upstream_state(a.url)["breaker"] == "closed"  # a client mistake is no replica failure


@pytest.mark.timeout(20)
def test_body_over_the_limit_is_a_413(upstreams, start_router) -> None:
    router = start_router([upstreams[0].url], max_body_bytes=1000)
    response = router.http.post("/v1/chat/completions", json={"model": "m", "messages": [], "pad": "x" * 2000})
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"


@pytest.mark.timeout(20)
def test_no_upstream_is_a_503_with_retry_after(start_router) -> None:
    router = start_router([])
    response = router.chat()
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "no_upstream_available"
    assert router.http.get("/ready").status_code == 503
    assert router.http.get("/health").status_code == 200


@pytest.mark.timeout(20)
def test_connection_error_before_first_byte_fails_over(upstreams, start_router) -> None:
    a = upstreams[0]
    doomed = FakeUpstream("doomed")
    urls = [a.url, doomed.url]
    router = start_router(urls)  # both answer the startup probe
    doomed.stop()  # now the port refuses connections
    session = session_homed_at(doomed.url, urls)
    response = router.chat(session=session, stream=True)
    assert response.status_code == 200
    assert content_of(sse_events(response.text.splitlines())) == "Hello from a!"
    assert len(a.completions_seen()) == 1
    assert router.upstream_state(doomed.url)["consecutive_failures"] == 1


@pytest.mark.timeout(20)
def test_stall_before_first_byte_fails_over(upstreams, start_router) -> None:
    a, b = upstreams[0], upstreams[1]
    b.mode = "stall"
    router = start_router([a.url, b.url], stall_timeout_s=0.3)
    session = session_homed_at(b.url, [a.url, b.url])
    started = time.monotonic()
    response = router.chat(session=session, stream=True)
    assert response.status_code == 200 and "Hello from a!" == content_of(sse_events(response.text.splitlines()))
    assert 0.3 <= time.monotonic() - started < 2.0
    assert len(b.completions_seen()) == 1 and len(a.completions_seen()) == 1


@pytest.mark.timeout(20)
def test_429_and_503_before_first_byte_fail_over(upstreams, start_router) -> None:
    a, b = upstreams[0], upstreams[1]
    urls = [a.url, b.url]
    router = start_router(urls)
    session = session_homed_at(b.url, urls)
    b.mode = "status429"
    assert router.chat(session=session).json()["choices"][0]["message"]["content"] == "Hello from a!"
    assert router.upstream_state(b.url)["ready"] is True  # overload is not unreadiness
    b.mode = "status503"
    assert router.chat(session=session).status_code == 200
    assert router.upstream_state(b.url)["ready"] is False  # draining: no new traffic until a probe says ready
    before = len(b.completions_seen())
    assert router.chat(session=session).status_code == 200
    assert len(b.completions_seen()) == before
    assert len(a.completions_seen()) == 3


@pytest.mark.timeout(20)
def test_when_every_replica_is_overloaded_the_client_gets_the_429(upstreams, start_router) -> None:
    for fake in upstreams[:2]:
        fake.mode = "status429"
    router = start_router([fake.url for fake in upstreams[:2]])
    response = router.chat()
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["message"] == "overloaded"


@pytest.mark.timeout(20)
def test_500_is_passed_through_not_retried(upstreams, start_router) -> None:
    a, b = upstreams[0], upstreams[1]
    a.mode = "error500"
    router = start_router([a.url, b.url])
    response = router.chat(session=session_homed_at(a.url, [a.url, b.url]))
    assert response.status_code == 500 and response.json()["error"]["message"] == "internal error"
    assert b.completions_seen() == []


@pytest.mark.timeout(20)
def test_break_after_first_byte_ends_with_a_clean_error_chunk(upstreams, start_router) -> None:
    a, b = upstreams[0], upstreams[1]
    a.mode = "drop"
    a.drop_after_chunks = 2
    urls = [a.url, b.url]
    router = start_router(urls)
    response = router.chat(session=session_homed_at(a.url, urls), stream=True)
    assert response.status_code == 200
    events = sse_events(response.text.splitlines())
    assert content_of(events) == "Hello from"  # the two chunks sent before the break
    assert events[-2]["error"]["code"] == "upstream_stream_broken"
    assert set(events[-2]["error"]) == {"message", "type", "param", "code"}
    assert events[-1] == "[DONE]"
    assert b.completions_seen() == []  # nothing is retried after the first byte


@pytest.mark.timeout(20)
def test_stall_after_first_byte_ends_with_an_error_chunk(upstreams, start_router) -> None:
    a = upstreams[0]
    a.mode = "stall_mid"
    a.drop_after_chunks = 1
    router = start_router([a.url], stall_timeout_s=0.3)
    started = time.monotonic()
    events = sse_events(router.chat(stream=True).text.splitlines())
    assert 0.3 <= time.monotonic() - started < 2.0
    assert content_of(events) == "Hello"
    assert events[-2]["error"]["code"] == "upstream_stream_stalled" and events[-1] == "[DONE]"
    assert a.stream_cancelled.wait(timeout=3)  # the router hung up on the stalled stream


@pytest.mark.timeout(20)
def test_deadline_passing_mid_stream_ends_with_an_error_chunk(upstreams, start_router) -> None:
    a = upstreams[0]
    a.chunk_delay_s = 1.0  # tokens at 0 s, 1 s, 2 s, 3 s
    router = start_router([a.url])
    started = time.monotonic()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    response = router.http.post("/v1/chat/completions", json=body, headers={"X-Request-Timeout": "1.5"})
    elapsed = time.monotonic() - started
    events = sse_events(response.text.splitlines())
    # Ended at the deadline, not at the next token (2 s) nor at the end of the stream (3 s).
    assert 1.5 <= elapsed < 2.0
    # Half a second of margin on either side of the deadline for the token at 1 s.
    assert content_of(events) == "Hello from"
    assert events[-2]["error"]["code"] == "deadline_exceeded" and events[-1] == "[DONE]"


@pytest.mark.timeout(20)
def test_a_half_sent_event_is_never_forwarded(start_router) -> None:
    """An upstream that dies mid-event: the client gets whole events, then the error event."""

    async def torn_stream(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await receive()
        if scope["path"] == "/ready":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        event = b'data: {"choices": [{"index": 0, "delta": {"content": "whole"}}]}\n\n'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": event + b'data: {"choices": [{"ind', "more_body": True})
        raise ConnectionAbortedError("dies mid-event")

    upstream = ServerThread(torn_stream)
    try:
        router = start_router([upstream.url])
        response = router.chat(stream=True)
        lines = [line for line in response.text.splitlines() if line]
        assert lines[0] == 'data: {"choices": [{"index": 0, "delta": {"content": "whole"}}]}'
        assert json.loads(lines[1][len("data: ") :])["error"]["code"] == "upstream_stream_broken"
        assert lines[2:] == ["data: [DONE]"]
    finally:
        upstream.stop()


@pytest.mark.timeout(20)
def test_client_disconnect_cancels_the_upstream_stream(upstreams, start_router) -> None:
    a = upstreams[0]
    a.tokens = [f" t{i}" for i in range(400)]
    a.chunk_delay_s = 0.02
    router = start_router([a.url])
    body = {"model": "m", "messages": [{"role": "user", "content": "long"}], "stream": True}
    with httpx.Client(base_url=router.url) as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 3:
                break
    assert a.stream_cancelled.wait(timeout=3), "upstream kept generating for a gone client"
    assert a.streams_finished == 0
    wait_until(lambda: router.upstream_state(a.url)["in_flight"] == 0, timeout_s=3)


@pytest.mark.timeout(20)
def test_sessions_stick_to_their_home_replica(upstreams, start_router) -> None:
    urls = [fake.url for fake in upstreams]
    router = start_router(urls)
    sessions = [f"user-{i}" for i in range(12)]
    for _ in range(3):
        for session in sessions:
            assert router.chat(session=session).status_code == 200
    for fake in upstreams:
        seen = [r.headers["x-session-id"] for r in fake.completions_seen()]
        for session in set(seen):
            assert seen.count(session) == 3  # every turn of a session on one replica
            assert rendezvous_order(session, urls)[0] == fake.url
    assert sum(len(fake.completions_seen()) for fake in upstreams) == 36
    assert sum(1 for fake in upstreams if fake.completions_seen()) >= 2


@pytest.mark.timeout(20)
def test_conversations_without_session_id_stick_by_their_opening(upstreams, start_router) -> None:
    router = start_router([fake.url for fake in upstreams])
    for conversation in range(8):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"question {conversation}"}]
        for turn in range(3):
            body = {"model": "m", "messages": messages}
            assert router.http.post("/v1/chat/completions", json=body).status_code == 200
            messages = messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"more {turn}"}]
    for fake in upstreams:
        openings = [json.dumps(r.body["messages"][:2]) for r in fake.completions_seen()]
        assert all(openings.count(o) == 3 for o in openings)
    assert sum(1 for fake in upstreams if fake.completions_seen()) >= 2


@pytest.mark.timeout(20)
def test_session_calls_and_models_are_passed_through(upstreams, start_router) -> None:
    urls = [fake.url for fake in upstreams]
    router = start_router(urls)
    session = "sess-77"
    home = rendezvous_order(session, urls)[0]
    info = router.http.get(f"/v1/sessions/{session}")
    assert info.status_code == 200 and info.json()["id"] == session
    assert [fake.url for fake in upstreams if fake.name == info.json()["served_by"]] == [home]
    models = router.http.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake-model"
    assert router.http.get("/v1/does-not-exist").status_code == 404  # the upstream's answer


@pytest.mark.timeout(20)
def test_connection_refused_everywhere_is_a_502(start_router) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    router = start_router([dead_url])
    # The startup probe already marked it not ready: nothing to try.
    assert router.chat().status_code == 503
    router.service.replicas.get(dead_url).ready = True  # as if the probe raced the crash
    response = router.chat()
    assert response.status_code == 502 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "upstream_unavailable"
