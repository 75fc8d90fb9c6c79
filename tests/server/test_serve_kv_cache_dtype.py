"""`ember serve --kv-cache-dtype float16`: it serves through the official openai client, and its pool holds twice the tokens."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from server_process import ServerProcess, metric_value

pytestmark = pytest.mark.timeout(300)
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def float16_server():
    with ServerProcess("--kv-cache-dtype", "float16", "--kv-cache-mb", "64", "--warmup-requests", "0") as proc:
        yield proc


def test_a_float16_cache_serves_and_its_pool_holds_twice_the_tokens(float16_server, loaded_model):
    from ember.engine.kv_cache import bytes_per_block

    client = openai.OpenAI(base_url=float16_server.url, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name three fruits."}], max_tokens=16, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text.strip()
    metrics = httpx.get(f"{float16_server.base}/metrics", timeout=30).text
    pool_bytes = metric_value(metrics, "llm_kv_cache_bytes")
    capacity = metric_value(metrics, "llm_kv_cache_capacity_tokens")
    block = bytes_per_block(loaded_model.config, 16, torch.float16)
    assert pool_bytes == 64 * MIB // block * block
    assert capacity == (64 * MIB // block - 1) * 16
    assert capacity >= 2 * (64 * MIB // bytes_per_block(loaded_model.config, 16, torch.float32) - 1) * 16


def test_an_unknown_cache_dtype_stops_serve_at_once():
    proc = ServerProcess("--kv-cache-dtype", "int4")
    assert proc.proc.wait(60) != 0
    assert "--kv-cache-dtype" in proc.log()
    proc.stop()
