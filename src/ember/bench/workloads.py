"""What the benchmark sends: request specs and deterministic prompt builders.

Everything here is a pure function of its arguments and a seeded
``random.Random``, so two runs with the same ``--seed`` send the same prompts.
Prompt sizes are given in words of a fixed list of short common English words,
which BPE tokenizers encode as about one token each; the server's ``usage``
reports the exact count, and the records keep it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Short, common words: each is one token (with its leading space) in the usual BPE vocabularies.
FILLER_WORDS = (
    "the of and to in is it that was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will "
    "up other about out many then them these so some her would make like him into time has look two more "
    "write go see number no way could people my than first water been call who oil its now find long down "
    "day did get come made may part over new sound take only little work know place year live me back give "
    "most very after thing our just name good sentence man think say great where help through much before "
    "line right too mean old any same tell boy follow came want show also around form three small set put "
    "end does another well large must big even such because turn here why ask went men read need land"
).split()

STORY_TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to bake bread",
    "two rival chess players stuck in an elevator",
    "a village where it has not rained for ten years",
    "a cat that can open every door",
    "the last library on a distant planet",
    "a street musician who plays only at midnight",
    "a map that redraws itself every morning",
    "a gardener who grows clocks instead of flowers",
    "a ship whose crew forgets one word each day",
    "a detective who solves crimes by smell",
    "a mountain that moves a little every night",
    "an old bicycle that remembers its riders",
    "a child who can talk to bridges",
    "a bakery that is open for one hour a year",
    "a letter delivered forty years late",
)

FOLLOW_UPS = (
    "Can you explain that in more detail?",
    "What would be a good next step?",
    "Give me an example of that.",
    "How does that compare to the alternative?",
    "What are the main risks there?",
    "Summarise what we said so far.",
    "What would you change about it?",
    "Why does that matter?",
)


@dataclass
class RequestSpec:
    """One chat completion to send, and the labels its record will carry.

    ``ignore_eos`` is an extension (Ember, vLLM): it is only put in the body when
    True, so a spec without it is plain OpenAI. ``session_id`` travels as the
    ``X-Session-ID`` header, which servers that do not know it ignore.
    """

    messages: list[dict[str, str]]
    max_tokens: int
    stream: bool = True
    ignore_eos: bool = False
    temperature: float | None = 0.0
    group: str = ""
    conversation_id: int | None = None
    turn: int | None = None
    session_id: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def body(self, model: str) -> dict[str, Any]:
        """The JSON body of ``POST /chat/completions`` for ``model``."""
        body: dict[str, Any] = {"model": model, "messages": self.messages, "max_tokens": self.max_tokens}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.stream:
            # Usage in the last chunk gives exact output token counts (else we count chunks).
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body

    def headers(self) -> dict[str, str]:
        """Extra request headers (the session id, when there is one)."""
        return {"X-Session-ID": self.session_id} if self.session_id else {}


SpecFactory = Callable[[int], RequestSpec]


def filler_text(num_words: int, rng: random.Random) -> str:
    """``num_words`` words from ``FILLER_WORDS`` drawn with ``rng`` (about as many tokens)."""
    return " ".join(rng.choice(FILLER_WORDS) for _ in range(num_words))


def cache_busting_prefix(rng: random.Random) -> str:
    """A unique opening line, so no cached prefix can match anything after it.

    Prefix caches hash blocks of tokens chained from the start of the prompt;
    a different first block changes every later hash, so the whole prompt is
    computed afresh.
    """
    return f"[request {rng.getrandbits(64):016x}]"


def story_prompt(index: int) -> list[dict[str, str]]:
    """A user message asking for a long story (request ``index`` picks the topic)."""
    topic = STORY_TOPICS[index % len(STORY_TOPICS)]
    return [{"role": "user", "content": f"Write a long, detailed story about {topic}."}]


def story_requests(max_tokens: int, *, ignore_eos: bool, stream: bool = True, group: str = "") -> SpecFactory:
    """Request ``i`` asks for a story with topic ``i`` (topics repeat every 16 requests)."""

    def make(index: int) -> RequestSpec:
        return RequestSpec(story_prompt(index), max_tokens, stream=stream, ignore_eos=ignore_eos, group=group)

    return make


def prefill_requests(prompt_words: int, seed: int, *, group: str = "prefill") -> SpecFactory:
    """Long prompts with a cache-busting first line and ``max_tokens=1``: TTFT is the prefill time."""

    def make(index: int) -> RequestSpec:
        rng = random.Random(f"{seed}:prefill:{index}")
        text = f"{cache_busting_prefix(rng)} {filler_text(prompt_words, rng)}\nSay OK."
        return RequestSpec([{"role": "user", "content": text}], max_tokens=1, group=group)

    return make


class Conversation:
    """A growing multi-turn chat: a system prompt, then user and assistant turns.

    The system prompt opens with a line unique to the conversation, so turn 1
    of every conversation is a cold prefill and later turns can only reuse
    their own history: TTFT by turn shows what keeping that history costs.
    """

    def __init__(self, conversation_id: int, *, system_words: int, seed: int, run_id: str) -> None:
        rng = random.Random(f"{seed}:conversation:{conversation_id}")
        self.conversation_id = conversation_id
        self.session_id = f"bench-{run_id}-{conversation_id}"
        system = f"{cache_busting_prefix(rng)} You are a helpful assistant. Background notes: {filler_text(system_words, rng)}"
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.turns_done = 0

    def next_request(self, max_tokens: int, *, ignore_eos: bool = False, group: str = "") -> RequestSpec:
        """The request of the next turn: the history so far plus a new user message."""
        turn = self.turns_done + 1
        if turn == 1:
            question = f"Tell me about {STORY_TOPICS[self.conversation_id % len(STORY_TOPICS)]}."
        else:
            question = FOLLOW_UPS[(self.conversation_id + turn) % len(FOLLOW_UPS)]
        self.messages.append({"role": "user", "content": question})
        return RequestSpec(
            list(self.messages),
            max_tokens,
            ignore_eos=ignore_eos,
            group=group,
            conversation_id=self.conversation_id,
            turn=turn,
            session_id=self.session_id,
        )

    def add_reply(self, text: str) -> None:
        """Append the assistant's reply to the turn just sent (a failed turn appends an empty one)."""
        self.messages.append({"role": "assistant", "content": text})
        self.turns_done += 1
