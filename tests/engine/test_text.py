"""Streamed text: never broken UTF-8, concatenates to the final text, no stop-string leaks."""

from __future__ import annotations

import pytest

from ember.engine.detokenizer import Detokenizer
from helpers import greedy, run_all

TEXTS = [
    "Café, naïve, crème brûlée, Ærøskøbing, São Paulo.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 🔥🚀👩‍👩‍👧‍👦 🇫🇷 and 🤖 with text between 🧪.",
    "Mixed: Ωmega ∑ ∫ √2 ≈ 1.414 — “quotes” «guillemets».",
]


def stream_pieces(detok: Detokenizer, ids: list[int], stop: list[str]) -> tuple[list[str], str | None]:
    """Feed ``ids`` one token at a time as the engine does; return the emitted pieces."""
    state = detok.start(0)
    pieces: list[str] = []
    for n in range(1, len(ids) + 1):
        delta, matched = detok.step(state, ids[:n], stop, False, True, n == len(ids))
        pieces.append(delta)
        if matched is not None:
            return pieces, matched
    return pieces, None


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_exactly_and_are_valid_utf8(fp32_engine, text):
    tok = fp32_engine.tokenizer
    ids = tok.encode(text)
    pieces, _ = stream_pieces(fp32_engine.detokenizer, ids, [])
    for piece in pieces:
        assert "\ufffd" not in piece
        piece.encode("utf-8")  # raises on lone surrogates
    assert "".join(pieces) == tok.decode(ids) == text


@pytest.mark.parametrize("stop", ["首都", "🚀", "brûlée", "≈ 1.4", "Par"])
def test_stop_strings_are_cut_exactly_and_never_leak(fp32_engine, stop):
    tok = fp32_engine.tokenizer
    text = next((t for t in TEXTS if stop in t), TEXTS[0] + " Paris")
    ids = tok.encode(text)
    pieces, matched = stream_pieces(fp32_engine.detokenizer, ids, [stop])
    assert matched == stop
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert stop not in emitted  # not even in an intermediate streamed state
    assert emitted == text[: text.index(stop)]


@pytest.mark.timeout(300)
def test_engine_stream_with_stop_string_and_unicode_prompt(fp32_engine):
    engine = fp32_engine
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Écris « bonjour » 🌍 trois fois."}])
    engine.add_request("free", ids, greedy(30, ignore_eos=True))
    free_text = "".join(o.text_delta for o in run_all(engine)["free"])
    assert len(free_text) > 6
    stop = free_text[4:7]
    engine.add_request("stopped", ids, greedy(30, ignore_eos=True, stop=[stop]))
    outs = run_all(engine)["stopped"]
    text = "".join(o.text_delta for o in outs)
    assert text == free_text[: free_text.index(stop)]
    assert outs[-1].finish_reason.value == "stop_string" and outs[-1].stop_reason == stop
