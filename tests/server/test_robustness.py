"""Hostile input, cancellation storms, deadlines and metrics against a real server."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from server_process import metric_value

pytestmark = pytest.mark.timeout(300)
HELLO = [{"role": "user", "content": "Hi"}]
LONG = [{"role": "user", "content": "Write a very long essay about the history of the Roman Empire."}]


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    if status is not None:
        assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"} and body["error"]["message"]
    return body["error"]


def assert_healthy(server) -> None:
    r = httpx.post(f"{server.url}/chat/completions", json={"messages": HELLO, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text


HOSTILE = [
    ("malformed json", b'{"messages": [', {}),
    ("not an object", b"[1, 2, 3]", {}),
    ("wrong type", json.dumps({"messages": "hello"}).encode(), {}),
    ("wrong role", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), {}),
    ("empty messages", json.dumps({"messages": []}).encode(), {}),
    ("huge max_tokens", json.dumps({"messages": HELLO, "max_tokens": 10**12}).encode(), {}),
    ("negative max_tokens", json.dumps({"messages": HELLO, "max_tokens": -5}).encode(), {}),
    ("negative temperature", json.dumps({"messages": HELLO, "temperature": -1}).encode(), {}),
    ("nan top_p", b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}', {}),
    ("string number", json.dumps({"messages": HELLO, "max_tokens": "many"}).encode(), {}),
    ("invalid utf-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', {}),
    ("image part", json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), {}),
    ("10,000 messages", json.dumps({"messages": HELLO * 10_000}).encode(), {}),
    ("empty body", b"", {}),
    ("bad timeout header", json.dumps({"messages": HELLO}).encode(), {"X-Request-Timeout": "soon"}),
    ("n over the choice limit", json.dumps({"messages": HELLO, "n": 17}).encode(), {}),  # n <= 16 is served
    ("huge seed", json.dumps({"messages": HELLO, "seed": 2**80}).encode(), {}),
    ("top_logprobs without logprobs", json.dumps({"messages": HELLO, "top_logprobs": 3}).encode(), {}),
]


@pytest.mark.parametrize("name,body,headers", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_get_4xx_and_server_stays_healthy(server, name, body, headers):
    r = httpx.post(f"{server.url}/chat/completions", content=body, headers={"Content-Type": "application/json", **headers}, timeout=60)
    assert_openai_error(r)
    assert r.status_code != 422


def test_ten_megabyte_body_is_413(server):
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 10_000_000}]}).encode()
    r = httpx.post(f"{server.url}/chat/completions", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert_openai_error(r, 413)
    # Chunked upload without Content-Length: the limit still holds.
    def chunks():
        for _ in range(10):
            yield b"x" * 1_000_000
    r = httpx.post(f"{server.url}/chat/completions", content=chunks(), headers={"Content-Type": "application/json"}, timeout=60)
    assert_openai_error(r, 413)
    assert_healthy(server)


def test_completions_hostile(server):
    for body in ({"prompt": ""}, {"prompt": ["a", "b"]}, {"prompt": [10**9]}, {"prompt": "x", "logprobs": 99}, {}):
        assert_openai_error(httpx.post(f"{server.url}/completions", json=body, timeout=30))
    assert_openai_error(httpx.get(f"{server.url}/nope"), 404)
    assert_openai_error(httpx.get(f"{server.url}/chat/completions"), 405)
    assert_healthy(server)


@pytest.fixture(scope="module")
def roomy_server():
    """Admission limits above 100, so every request of the storm really is in flight."""
    from server_process import ServerProcess

    proc = ServerProcess("--max-running", "128", "--max-queue", "128", "--warmup-requests", "1").wait_ready()
    yield proc
    proc.stop()


def test_cancellation_storm_leaks_nothing(roomy_server):
    """100 streams, all in flight at once, all dropped by their clients mid-answer: nothing leaks.

    Each client reads its first chunk, waits until every other client has one too, then closes its
    connection: the cut is the client's decision, not a timing accident (a read timeout let streams
    that never paused for long finish, and how many did depended on the machine's speed).
    """
    server = roomy_server
    idle = metric_value(server.metrics(), "llm_kv_cache_usage_ratio")
    clients = 100
    body = {"messages": LONG, "stream": True, "max_tokens": 1000, "ignore_eos": True}

    settled: list[str] = []  # one entry per client that is streaming, or was refused or finished
    everyone_settled = asyncio.Event()

    def settle(how: str) -> None:
        settled.append(how)
        if len(settled) == clients:
            everyone_settled.set()

    async def one(client: httpx.AsyncClient) -> str:
        async with client.stream("POST", f"{server.url}/chat/completions", json=body) as r:
            if r.status_code != 200:
                settle("refused")
                return f"http_{r.status_code}"
            async for chunk in r.aiter_text():
                if '"content"' in chunk:  # past the role-only first delta: generating
                    settle("streaming")
                    await everyone_settled.wait()
                    return "cut"  # leaving the block closes the connection mid-stream
        settle("finished")
        return "finished"

    async def storm() -> list[str]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*[one(client) for _ in range(clients)]), 120)

    results = asyncio.run(storm())
    assert results == ["cut"] * clients, results  # every one was streaming when its client gave up
    started = time.monotonic()
    assert_healthy(server)
    assert time.monotonic() - started < 10
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if metric_value(server.metrics(), "llm_kv_cache_usage_ratio") <= idle and metric_value(server.metrics(), "llm_requests_running") == 0:
            break
        time.sleep(0.2)
    assert metric_value(server.metrics(), "llm_kv_cache_usage_ratio") <= idle
    assert metric_value(server.metrics(), "llm_requests_running") == 0


def test_non_streaming_disconnect_aborts(server):
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/chat/completions", json={"messages": LONG, "max_tokens": 400, "ignore_eos": True}, timeout=0.5)
    deadline = time.monotonic() + 5
    while metric_value(server.metrics(), "llm_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric_value(server.metrics(), "llm_requests_running") == 0


def test_deadline_stops_generation_on_time(server):
    import openai

    client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
    started = time.monotonic()
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=LONG, max_tokens=1000, extra_body={"timeout": 0.5, "ignore_eos": True})
    elapsed = time.monotonic() - started
    assert elapsed < 3.0, elapsed  # 1000 tokens would take ~8 s
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].model_extra.get("stop_reason") == "timeout"
    assert 0 < r.usage.completion_tokens < 1000
    # Streamed, via the header: the last chunk before [DONE] carries the marker.
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=LONG, max_tokens=1000, stream=True,
                                            extra_body={"ignore_eos": True}, extra_headers={"X-Request-Timeout": "0.5"})
    chunks = list(stream)
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length" and last.model_extra.get("stop_reason") == "timeout"
    assert metric_value(server.metrics(), "llm_requests_running") == 0


def test_max_tokens_preset_and_limit_are_visible(server):
    r = httpx.post(f"{server.url}/chat/completions", json={"messages": LONG, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    assert r.headers["x-ember-max-tokens"] == "80"  # the support profile's default
    assert r.json()["usage"]["completion_tokens"] == 80
    clamped_before = _or_zero(server.metrics(), "llm_max_tokens_clamped_total")
    r = httpx.post(f"{server.url}/chat/completions", json={"messages": HELLO, "max_tokens": 5000}, timeout=60)
    assert r.headers["x-ember-max-tokens"] == "1024" and r.headers["x-ember-max-tokens-clamped"] == "1"
    assert metric_value(server.metrics(), "llm_max_tokens_clamped_total") == clamped_before + 1


def test_request_id_echoed_or_generated(server):
    for good in ("abc-123", "svc:frontend.42_x", "0" * 128, "01J9Z3K7Q8V6XW2M4N5P"):
        assert httpx.get(f"{server.url}/models", headers={"X-Request-ID": good}).headers["x-request-id"] == good
    assert len(httpx.get(f"{server.url}/models").headers["x-request-id"]) >= 16
    # Not a reasonable token: too long, spaces, tabs, non-ASCII bytes, quotes, slashes, empty. Replaced, not refused
    # (control bytes never reach the app: the HTTP parser answers 400 itself).
    for bad in ("a" * 129, "has space", "tab\there", "caf\xe9".encode("latin-1"), '"quoted"', "a/b", ""):
        r = httpx.get(f"{server.url}/models", headers={"X-Request-ID": bad})
        assert r.status_code == 200
        echoed = r.headers["x-request-id"]
        assert echoed != (bad.decode("latin-1") if isinstance(bad, bytes) else bad)
        assert len(echoed) == 32 and all(c in "0123456789abcdef" for c in echoed), echoed


def test_a_reused_request_id_never_mixes_two_requests(server):
    """Clients reuse ids; the engine's own id stays unique, so each stream gets its own tokens."""

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, str]:
        body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": 12, "temperature": 0}
        async with client.stream("POST", f"{server.url}/chat/completions", json=body, headers={"X-Request-ID": "same-id"}) as r:
            assert r.status_code == 200
            text = (await r.aread()).decode()
            return r.headers["x-request-id"], text

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(one(client, "Name a fruit."), one(client, "Name a color."))

    (id_a, text_a), (id_b, text_b) = asyncio.run(main())
    assert id_a == id_b == "same-id"
    for text in (text_a, text_b):
        assert text.count('"finish_reason":"length"') + text.count('"finish_reason":"stop"') == 1, text
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
    alone_a = httpx.post(f"{server.url}/chat/completions", json={"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 12, "temperature": 0}, timeout=60)
    content_a = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in text_a.splitlines()
                        if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert content_a == alone_a.json()["choices"][0]["message"]["content"]  # its own answer, not the other's


def test_metrics_parse_and_count_requests(server):
    before = server.metrics()
    n_before = metric_value(before, "llm_request_duration_seconds_count")
    ttft_before = metric_value(before, "llm_time_to_first_token_seconds_count")
    for _ in range(3):
        httpx.post(f"{server.url}/chat/completions", json={"messages": HELLO, "max_tokens": 4}, timeout=60).raise_for_status()
    after = server.metrics()
    assert metric_value(after, "llm_request_duration_seconds_count") == n_before + 3
    assert metric_value(after, "llm_time_to_first_token_seconds_count") == ttft_before + 3
    for name in ("llm_inter_token_latency_seconds_count", "llm_request_queue_seconds_count", "llm_prompt_tokens_total",
                 "llm_generation_tokens_total", "llm_requests_waiting", "llm_kv_cache_bytes", "process_resident_memory_bytes"):
        metric_value(after, name)
    errors_before = _or_zero(after, "llm_request_errors_total", {"code": "400"})
    assert httpx.post(f"{server.url}/chat/completions", json={"messages": []}, timeout=30).status_code == 400
    assert metric_value(server.metrics(), "llm_request_errors_total", {"code": "400"}) == errors_before + 1


def _or_zero(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    try:
        return metric_value(text, name, labels)
    except KeyError:
        return 0.0  # no sample yet
