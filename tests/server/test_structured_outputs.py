"""response_format through the official openai client against a real `ember serve`.

The headline check: 100 replies over five schemas (nested objects, arrays,
enums, bounded numbers, required and optional fields), half streamed, at
temperature 0.8 and 16 at a time, next to free-text requests so that batches
mix constrained and free rows: every one parses and validates.

The schemas bound what a small model could otherwise run on with until
max_tokens: string lengths, list lengths, and decimals (``multiple_of``; at
temperature 0.8 a 135M model writes 2.1399999... for an unbounded float).
"""

from __future__ import annotations

import asyncio
import enum
import json
from typing import Annotated, Literal, Optional

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from server_process import metric_value

pytestmark = pytest.mark.timeout(300)
MODEL = "ember"
# A deadline far from the test's way: a slow shared machine must not turn a reply into "length".
SLOW_OK = {"timeout": 120}


class Strict(BaseModel):
    """additionalProperties: false, as OpenAI's strict mode wants (else a model may add keys of its own)."""

    model_config = ConfigDict(extra="forbid")


class Address(Strict):
    street: str = Field(max_length=40)
    city: str = Field(max_length=30)


class Person(Strict):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "editor", "viewer"]
    address: Address
    nickname: Optional[str] = Field(default=None, max_length=20)


class Status(str, enum.Enum):
    pending = "pending"
    shipped = "shipped"
    delivered = "delivered"


class LineItem(Strict):
    sku: str = Field(max_length=12)
    quantity: int = Field(ge=1, le=99)
    unit_price: float = Field(ge=0, le=1000, multiple_of=0.01)


class Order(Strict):
    order_id: int = Field(ge=1, le=999999)
    status: Status
    items: list[LineItem] = Field(min_length=1, max_length=3)


class Reading(Strict):
    station: str = Field(max_length=20)
    celsius: float = Field(ge=-50, le=50, multiple_of=0.1)
    humidity: float = Field(ge=0, le=1, multiple_of=0.01)
    condition: Literal["sunny", "cloudy", "rain", "snow"]


class Priority(str, enum.Enum):
    low = "low"
    high = "high"


class Ticket(Strict):
    summary: str = Field(max_length=60)
    priority: Priority
    tags: list[Annotated[str, Field(max_length=20)]] = Field(max_length=3)
    assignee: Optional[str] = Field(default=None, max_length=20)


class Ingredient(Strict):
    name: str = Field(max_length=20)
    grams: int = Field(ge=1, le=1000)


class Recipe(Strict):
    title: str = Field(max_length=40)
    vegetarian: bool
    minutes: int = Field(ge=1, le=600)
    ingredients: list[Ingredient] = Field(min_length=1, max_length=3)


SCHEMAS: list[tuple[type[BaseModel], str]] = [
    (Person, "Invent a user of a website and describe them as JSON."),
    (Order, "Invent a small shop order as JSON."),
    (Reading, "Give today's weather at a station in Oslo as JSON."),
    (Ticket, "File a support ticket about a login problem, as JSON."),
    (Recipe, "Write a short pancake recipe as JSON."),
]


def messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


async def _parsed_reply(aclient: openai.AsyncOpenAI, model: type[BaseModel], prompt: str, stream: bool, seed: int) -> tuple[BaseModel | None, str, str]:
    kwargs = dict(model=MODEL, messages=messages(prompt), response_format=model, temperature=0.8, seed=seed, max_tokens=160, extra_body=SLOW_OK)
    if stream:
        async with aclient.chat.completions.stream(**kwargs) as events:
            async for _ in events:
                pass
            completion = await events.get_final_completion()
    else:
        completion = await aclient.chat.completions.parse(**kwargs)
    choice = completion.choices[0]
    return choice.message.parsed, choice.message.content or "", choice.finish_reason


async def _free_reply(aclient: openai.AsyncOpenAI, seed: int) -> str:
    r = await aclient.chat.completions.create(model=MODEL, messages=messages("Tell me about the sea."), temperature=0.8, seed=seed, max_tokens=40, extra_body=SLOW_OK)
    return r.choices[0].finish_reason


def test_hundred_parsed_replies_over_five_schemas_all_validate(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=180)
        gate = asyncio.Semaphore(16)

        async def one(i: int):
            model, prompt = SCHEMAS[i % len(SCHEMAS)]
            async with gate:
                if i % 10 == 9:  # a free request in the mix: batches hold constrained and free rows
                    return ("free", await _free_reply(aclient, i)), model
                stream = i % 2 == 0
                return (stream, *await _parsed_reply(aclient, model, prompt, stream, seed=i)), model

        try:
            return await asyncio.gather(*(one(i) for i in range(112)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    structured = [(r, m) for r, m in results if r[0] != "free"]
    assert len(structured) >= 100
    for (_, parsed, content, finish), model in structured:
        assert finish == "stop", (model.__name__, content)
        assert isinstance(parsed, model), content
        assert model.model_validate_json(content) == parsed  # the text itself validates, not only the client's parse
    assert sum(1 for (stream, *_), _ in structured if stream) >= 50
    assert {model for _, model in structured} == {model for model, _ in SCHEMAS}
    free = [r[1] for r, _ in results if r[0] == "free"]
    assert len(free) >= 10 and set(free) <= {"stop", "length"}


def test_json_object_is_one_object(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=messages("Describe a cat as JSON."), response_format={"type": "json_object"},
            temperature=0.8, seed=seed, max_tokens=120, extra_body=SLOW_OK,
        )
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:  # a long object may be cut by max_tokens; what there is still starts as an object
            assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


def test_truncated_object_ends_with_length(client):
    r = client.chat.completions.create(model=MODEL, messages=messages(SCHEMAS[0][1]), response_format=_schema_format(Person), max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model=MODEL, messages=messages(SCHEMAS[0][1]), response_format=Person, max_tokens=6, temperature=0)


def _schema_format(model: type[BaseModel]) -> dict:
    return {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": model.model_json_schema(), "strict": True}}


def test_stop_string_cuts_a_structured_reply(client):
    full = client.chat.completions.create(model=MODEL, messages=messages(SCHEMAS[2][1]), response_format=_schema_format(Reading), temperature=0, max_tokens=100)
    content = full.choices[0].message.content
    Reading.model_validate_json(content)
    cut = client.chat.completions.create(model=MODEL, messages=messages(SCHEMAS[2][1]), response_format=_schema_format(Reading), temperature=0, max_tokens=100, stop=['"celsius"'])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == content[: content.index('"celsius"')]


def test_seeded_structured_replies_repeat_and_streaming_matches(client):
    kwargs = dict(model=MODEL, messages=messages(SCHEMAS[4][1]), response_format=_schema_format(Recipe), temperature=0.8, seed=1234, max_tokens=160, extra_body=SLOW_OK)
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    again = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs) if c.choices)
    assert first == again == streamed
    Recipe.model_validate_json(first)


def test_n_choices_each_follow_the_schema_and_share_the_prompt(server, client):
    prompt = messages("Give today's weather at a station as JSON. " + "Be precise and use metric units. " * 8)
    before = metric_value(server.metrics(), "llm_prefix_cache_hits_total")
    r = client.chat.completions.create(model=MODEL, messages=prompt, response_format=_schema_format(Reading), n=4, temperature=0.8, seed=7, max_tokens=100, extra_body=SLOW_OK)
    hits = metric_value(server.metrics(), "llm_prefix_cache_hits_total") - before
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        Reading.model_validate_json(choice.message.content)
    assert len({c.message.content for c in r.choices}) > 1  # copies sample on their own
    # The first choice computes the prompt; the three copies find its full 16-token blocks cached.
    full_blocks = r.usage.prompt_tokens // 16 * 16
    assert hits >= 3 * full_blocks, (hits, r.usage.prompt_tokens)


def test_session_turns_with_a_schema_reuse_the_cache(client):
    history = messages(SCHEMAS[1][1])
    kwargs = dict(model=MODEL, response_format=_schema_format(Order), temperature=0, max_tokens=120, extra_body={"session_id": "structured-session", **SLOW_OK})
    first = client.chat.completions.create(messages=history, **kwargs)
    Order.model_validate_json(first.choices[0].message.content)
    history += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Now another order, please."}]
    second = client.chat.completions.create(messages=history, **kwargs)
    Order.model_validate_json(second.choices[0].message.content)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16


def test_a_schema_the_library_cannot_use_is_a_400(server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}
    r = httpx.post(f"{server.url}/chat/completions", json={"messages": messages("hi"), "response_format": bad}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "response_format.json_schema.schema"
    r = httpx.post(f"{server.url}/chat/completions", json={"messages": messages("hi"), "response_format": {"type": "yaml"}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("response_format")


def test_logit_bias_forbids_and_forces_tokens(server, client):
    plain = client.chat.completions.create(model=MODEL, messages=messages("What is the capital of France?"), temperature=0, max_tokens=8)
    text = plain.choices[0].message.content
    ids = httpx.post(f"{server.base}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30).json()["tokens"]
    banned = client.chat.completions.create(model=MODEL, messages=messages("What is the capital of France?"), temperature=0, max_tokens=8, logit_bias={str(ids[0]): -100})
    assert banned.choices[0].message.content != text
    forced_id = httpx.post(f"{server.base}/tokenize", json={"prompt": " banana", "add_special_tokens": False}, timeout=30).json()["tokens"][0]
    forced = client.chat.completions.create(model=MODEL, messages=messages("Hi"), temperature=0, max_tokens=3, logit_bias={str(forced_id): 100})
    assert forced.choices[0].message.content == " banana" * 3
    r = httpx.post(f"{server.url}/chat/completions", json={"messages": messages("hi"), "logit_bias": {"abc": 1}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    r = httpx.post(f"{server.url}/chat/completions", json={"messages": messages("hi"), "logit_bias": {"99999999": 1}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_tokenize_detokenize_and_echo(server, client):
    t = httpx.post(f"{server.base}/tokenize", json={"prompt": "The sky is blue", "return_token_strs": True}, timeout=30).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] > 0
    assert httpx.post(f"{server.base}/detokenize", json={"tokens": t["tokens"]}, timeout=30).json()["prompt"].endswith("The sky is blue")
    chat = httpx.post(f"{server.base}/tokenize", json={"messages": messages("The sky is blue")}, timeout=30).json()
    r = client.chat.completions.create(model=MODEL, messages=messages("The sky is blue"), max_tokens=1)
    assert chat["count"] == r.usage.prompt_tokens  # what a chat request costs
    bad = httpx.post(f"{server.base}/detokenize", json={"tokens": [1, -5]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens.1"
    echoed = client.completions.create(model=MODEL, prompt="The sky is", echo=True, max_tokens=5, temperature=0)
    plain = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0)
    assert echoed.choices[0].text == "The sky is" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt="The sky is", echo=True, max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == echoed.choices[0].text
    r = httpx.post(f"{server.url}/completions", json={"prompt": "x", "echo": True, "logprobs": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_models_card_shows_generation_defaults(server):
    card = httpx.get(f"{server.url}/models", timeout=30).json()["data"][0]
    defaults = card["generation_defaults"]
    # The default profile is "support": short and near-deterministic.
    assert defaults["temperature"] == 0.2 and defaults["top_p"] == 0.9 and defaults["max_tokens"] == 80
    assert defaults["sources"]["temperature"] == "profile"
