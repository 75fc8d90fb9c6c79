"""OpenAI's Predicted Outputs (``prediction``) and prompt-lookup speculation, through the official client.

A prediction only makes the answer sooner: the text is the one the same
request gets without it, and ``usage.completion_tokens_details`` says how many
of its tokens the answer took.
"""

from __future__ import annotations

import time

import openai
import pytest

from benchmarks.speculation_bench import spec_counters
from test_overload import access_entry

pytestmark = pytest.mark.timeout(180)

MODEL = "SmolLM2-135M-Instruct"
PARAGRAPH = (
    "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin nuzzled into his "
    "breast in an effort to escape the vile wind, slipped quickly through the glass doors of Victory Mansions."
)
REWRITE = [{"role": "user", "content": "Rewrite this paragraph with the spelling fixed: " + PARAGRAPH.replace("bright", "brigth")}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def test_prediction_reports_usage_and_changes_nothing(client, server):
    plain = client.chat.completions.create(model=MODEL, messages=REWRITE, temperature=0, max_tokens=80)
    details = plain.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == 0 and details.rejected_prediction_tokens == 0
    before = spec_counters(server)
    predicted = client.chat.completions.create(
        model=MODEL,
        messages=REWRITE,
        temperature=0,
        max_tokens=80,
        prediction={"type": "content", "content": PARAGRAPH},
        extra_headers={"X-Request-Id": "predicted-1"},
    )
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    details = predicted.usage.completion_tokens_details
    print(f"\nprediction: {details.accepted_prediction_tokens} accepted, {details.rejected_prediction_tokens} rejected")
    assert details.accepted_prediction_tokens > 10  # the answer copies most of the paragraph
    assert details.rejected_prediction_tokens >= 0
    drafted, accepted = (after - b for after, b in zip(spec_counters(server), before, strict=True))
    assert drafted >= accepted >= details.accepted_prediction_tokens
    entry = access_entry(server, "predicted-1")
    assert entry["draft_tokens"] >= entry["accepted_draft_tokens"] >= details.accepted_prediction_tokens


def test_prediction_streams_with_usage_and_as_text_parts(client):
    plain = client.chat.completions.create(model=MODEL, messages=REWRITE, temperature=0, max_tokens=40).choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        messages=REWRITE,
        temperature=0,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
        prediction={"type": "content", "content": [{"type": "text", "text": PARAGRAPH[:60]}, {"type": "text", "text": PARAGRAPH[60:]}]},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 5


def test_a_malformed_prediction_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=REWRITE, max_tokens=5, prediction={"type": "image", "content": "x"})
    assert "prediction" in info.value.body["param"]


def test_seeded_sampling_is_the_same_with_and_without_a_prediction(client):
    kwargs = {"model": MODEL, "messages": REWRITE, "temperature": 0.8, "top_p": 0.95, "seed": 7, "max_tokens": 60}
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    started = time.monotonic()
    predicted = client.chat.completions.create(**kwargs, prediction={"type": "content", "content": PARAGRAPH}).choices[0].message.content
    assert predicted == plain, f"after {time.monotonic() - started:.1f}s"
