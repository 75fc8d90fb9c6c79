"""Which session a request belongs to."""

from __future__ import annotations

import pytest

from ember.router.session_key import MalformedBodyError, key_from_body, key_from_path, parse_json_object

SYSTEM = {"role": "system", "content": "You are terse."}


def turn(*contents: str) -> list[dict[str, str]]:
    """A conversation: the system prompt, then alternating user / assistant messages."""
    roles = ["user", "assistant"]
    return [SYSTEM] + [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]


@pytest.mark.timeout(5)
def test_explicit_ids_win_in_order() -> None:
    body = {"session_id": "s-1", "user": "u-1", "messages": turn("hi")}
    assert key_from_body(body, 1024) == "s-1"
    assert key_from_body({"user": "u-1", "messages": turn("hi")}, 1024) == "u-1"
    assert key_from_body({"session_id": "", "user": "u-1"}, 1024) == "u-1"


@pytest.mark.timeout(5)
def test_later_turns_of_a_conversation_keep_its_key() -> None:
    first = key_from_body({"messages": turn("What is 2+2?")}, 1024)
    third = key_from_body({"messages": turn("What is 2+2?", "4", "And 3+3?", "6", "Thanks")}, 1024)
    other = key_from_body({"messages": turn("What is 5+5?")}, 1024)
    assert first is not None and first.startswith("conv:")
    assert first == third
    assert other != first
    verbose = [{"role": "system", "content": "Be verbose."}] + turn("What is 2+2?")[1:]
    other_system = key_from_body({"messages": verbose}, 1024)
    assert other_system != first


@pytest.mark.timeout(5)
def test_completion_prompts_hash_their_opening() -> None:
    opening = "x" * 40
    assert key_from_body({"prompt": opening + " turn one"}, 40) == key_from_body({"prompt": opening + " turn two"}, 40)
    assert key_from_body({"prompt": [1, 2, 3, 4, 5]}, 6) == key_from_body({"prompt": [1, 2, 3, 4, 9]}, 6)
    assert key_from_body({"prompt": "a"}, 40) != key_from_body({"prompt": "b"}, 40)
    assert key_from_body({"model": "m"}, 40) is None


@pytest.mark.timeout(5)
def test_session_paths_carry_their_id() -> None:
    assert key_from_path("/v1/sessions/abc") == "abc"
    assert key_from_path("/v1/sessions/abc/messages") == "abc"
    assert key_from_path("/v1/sessions/") is None
    assert key_from_path("/v1/chat/completions") is None


@pytest.mark.timeout(5)
@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe", b"42"])
def test_bodies_that_are_not_json_objects_are_rejected(body: bytes) -> None:
    with pytest.raises(MalformedBodyError):
        parse_json_object(body)
    assert parse_json_object(b'{"a": 1}') == {"a": 1}
