"""Sessions through the server: multi-turn reuse, /v1/sessions, key isolation, restart."""

from __future__ import annotations

import httpx
import openai
import pytest

from server_process import ServerProcess, metric_value

pytestmark = pytest.mark.timeout(300)
SYSTEM = {"role": "system", "content": "You are a helpful travel assistant. Answer briefly. " * 8}


def converse(client: openai.OpenAI, session: str, turns: list[str]) -> list:
    messages = [SYSTEM]
    replies = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=24,
                                           extra_headers={"X-Session-ID": session})
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        replies.append(r)
    return replies


def test_multi_turn_conversation_reuses_its_kv(server):
    client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
    replies = converse(client, "trip-1", ["Where is Lisbon?", "What should I eat there?", "And in Porto?"])
    first, *later = [r.usage for r in replies]
    for previous, usage in zip([first, *later], later):
        # Everything before the new user message was reused, generated tokens included.
        assert usage.prompt_tokens_details.cached_tokens >= previous.prompt_tokens + previous.completion_tokens - 16
        assert usage.prompt_tokens_details.cache_tier == "hot"  # the conversation's blocks were still in the pool
    listed = httpx.get(f"{server.url}/sessions").json()["data"]
    mine = [s for s in listed if s["id"] == "trip-1"]
    assert mine and mine[0]["tier"] == "hot" and mine[0]["tokens"] > replies[-1].usage.prompt_tokens
    one = httpx.get(f"{server.url}/sessions/trip-1").json()
    assert one["location"] == "pool" and one["expires_in_s"] > 0 and one["bytes"] > 0
    metrics = server.metrics()
    assert metric_value(metrics, "llm_sessions", {"tier": "hot"}) >= 1
    assert metric_value(metrics, "llm_prefix_cache_hits_total", {"tier": "hot"}) > 0
    assert httpx.delete(f"{server.url}/sessions/trip-1").json()["deleted"] is True
    assert httpx.get(f"{server.url}/sessions/trip-1").status_code == 404
    assert httpx.delete(f"{server.url}/sessions/trip-1").status_code == 404


def test_api_keys_namespace_sessions():
    proc = ServerProcess("--api-key", "alpha", "--warmup-requests", "1").wait_ready()
    try:
        converse(openai.OpenAI(base_url=proc.url, api_key="alpha", max_retries=0), "shared-name", ["Hello!"])
        mine = httpx.get(f"{proc.url}/sessions", headers={"Authorization": "Bearer alpha"}).json()["data"]
        assert [s["id"] for s in mine] == ["shared-name"]
        assert httpx.get(f"{proc.url}/sessions").status_code == 401
    finally:
        proc.stop()


def test_warm_session_survives_restart(tmp_path):
    args = ("--session-dir", str(tmp_path), "--warmup-requests", "1")
    first = ServerProcess(*args).wait_ready()
    client = openai.OpenAI(base_url=first.url, api_key="x", max_retries=0)
    replies = converse(client, "persist-me", ["Name a famous bridge."])
    history = [SYSTEM, {"role": "user", "content": "Name a famous bridge."}, {"role": "assistant", "content": replies[0].choices[0].message.content}]
    assert first.stop() == 0  # graceful: hot sessions are written to session_dir
    assert any(p.suffix == ".ekv" for p in tmp_path.iterdir())

    second = ServerProcess(*args).wait_ready()
    try:
        listed = httpx.get(f"{second.url}/sessions/persist-me").json()
        assert listed["tier"] == "warm" and listed["location"] == "disk"
        client = openai.OpenAI(base_url=second.url, api_key="x", max_retries=0)
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[*history, {"role": "user", "content": "How long is it?"}],
                                           temperature=0, max_tokens=8, extra_headers={"X-Session-ID": "persist-me"})
        before = replies[0].usage
        # Every full block of the first turn (its last sampled token has no KV yet) came back from disk.
        assert r.usage.prompt_tokens_details.cached_tokens == (before.prompt_tokens + before.completion_tokens - 1) // 16 * 16
        assert r.usage.prompt_tokens_details.cache_tier == "disk"  # the warm tier, from its files
        assert metric_value(second.metrics(), "llm_prefix_cache_hits_total", {"tier": "disk"}) > 0
    finally:
        second.stop()
