"""server/tools.py and server/defaults.py: pure parts, no server."""

from __future__ import annotations

import json

import pytest

from ember.server.defaults import resolve_defaults
from ember.server.tools import ReplyParser, format_call


def _feed_in_pieces(parser: ReplyParser, text: str, size: int):
    content, pieces = "", []
    for i in range(0, len(text), size):
        c, d = parser.feed(text[i : i + size])
        content += c
        pieces.extend(d)
    return content, pieces


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_calls_streamed_in_any_pieces_match_the_whole(size):
    args = [json.dumps({"city": 'Pa"ris}', "n": [1, {"x": "}"}]}, separators=(",", ":")), "{}"]
    text = format_call("get_weather", args[0]) + "\n" + format_call("noop", args[1])
    whole = ReplyParser("required")
    assert whole.feed(text)[0] == ""
    parser = ReplyParser("required")
    content, pieces = _feed_in_pieces(parser, text, size)
    assert content == ""
    assert [(c.name, c.arguments, c.complete) for c in parser.calls] == [("get_weather", args[0], True), ("noop", "{}", True)]
    assert [(c.name, c.arguments) for c in whole.calls] == [(c.name, c.arguments) for c in parser.calls]
    by_call: dict[int, str] = {}
    for piece in pieces:
        by_call[piece.index] = by_call.get(piece.index, "") + piece.arguments
        if piece.id is not None:
            assert piece.name == parser.calls[piece.index].name and piece.id == parser.calls[piece.index].id
    assert by_call == {0: args[0], 1: "{}"}


def test_auto_reply_is_text_unless_it_starts_a_call():
    text = ReplyParser("auto")
    assert text.feed("Sure, ")[0] == "Sure, " and text.feed("<b>")[0] == "<b>"
    assert not text.made_calls
    call = ReplyParser("auto")
    call.feed(format_call("add", '{"a":1}'))
    assert call.made_calls and call.calls[0].arguments == '{"a":1}'


def test_a_cut_call_stays_incomplete():
    parser = ReplyParser("required")
    parser.feed(format_call("add", '{"a":12}')[:-14])  # all but the closing brace and tag
    assert parser.calls[0].arguments == '{"a":12}' and not parser.calls[0].complete


def test_generation_defaults_precedence():
    d = resolve_defaults("support", {})
    assert (d.get("temperature"), d.get("top_p"), d.get("max_tokens")) == (0.2, 0.9, 80)
    d = resolve_defaults("creative", {"temperature": 0.6, "top_k": 20.0}, default_top_p=0.5)
    assert d.get("temperature") == 0.6 and d.sources["temperature"] == "model"
    assert d.get("top_k") == 20 and d.get("top_p") == 0.5 and d.sources["top_p"] == "server"
    assert d.get("max_tokens") == 300
