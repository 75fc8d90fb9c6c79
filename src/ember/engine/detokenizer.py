"""Incremental detokenization with exact stop strings.

Two rules make streamed text safe:

* **No broken UTF-8.** A multi-byte character (an emoji, a CJK character) can be
  split across tokens. Text is emitted only when decoding the new tokens does
  not end in U+FFFD, the replacement character a partial sequence decodes to;
  otherwise the tokens wait for the rest of the character.
* **Stop strings never leak.** The last ``len(longest stop) - 1`` characters are
  held back until later text shows they do not begin a stop string. When a stop
  string appears, the text is cut right before it (or after it, with
  ``include_stop_str_in_output``) and the request finishes.

Invariant: the concatenation of every emitted delta equals the final text.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer as HFTokenizer

# Prompt tokens decoded with the output, so a first token's leading space (or
# SentencePiece marker) renders as it would mid-text.
_CONTEXT_TOKENS = 5


@dataclass
class DetokenizerState:
    prefix_offset: int
    read_offset: int
    text: str = ""  # all decoded output text so far
    emitted: int = 0  # characters of ``text`` already handed out
    stopped: bool = False


class Detokenizer:
    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tok = tokenizer

    def start(self, num_prompt_tokens: int) -> DetokenizerState:
        return DetokenizerState(prefix_offset=max(0, num_prompt_tokens - _CONTEXT_TOKENS), read_offset=num_prompt_tokens)

    def step(
        self, state: DetokenizerState, token_ids: list[int], stop: list[str], include_stop: bool, skip_special: bool, finished: bool
    ) -> tuple[str, str | None]:
        """Decode the tokens added since the last call.

        Returns ``(delta, matched_stop)``: the text now safe to emit, and the
        stop string that ended the text (None if none matched). With
        ``finished`` the held-back tail is flushed.
        """
        if state.stopped:
            return "", None
        prefix = self._tok.decode(token_ids[state.prefix_offset : state.read_offset], skip_special_tokens=skip_special)
        full = self._tok.decode(token_ids[state.prefix_offset :], skip_special_tokens=skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new_text = full[len(prefix) :]
            state.prefix_offset, state.read_offset = state.read_offset, len(token_ids)
            start_search = max(0, len(state.text) - max((len(s) for s in stop), default=0) + 1)
            state.text += new_text
            matched = _find_stop(state.text, stop, start_search)
            if matched is not None:
                position, stop_string = matched
                end = position + len(stop_string) if include_stop else position
                state.text = state.text[:end]
                state.stopped = True
                return self._take(state, len(state.text)), stop_string
        elif finished and full.endswith("\ufffd") and len(full) > len(prefix):
            # The stream ended inside a character: emit what the tokens decode to.
            state.text += full[len(prefix) :]
        hold = 0 if finished else max((len(s) for s in stop), default=1) - 1
        return self._take(state, max(state.emitted, len(state.text) - hold)), None

    @staticmethod
    def _take(state: DetokenizerState, upto: int) -> str:
        delta = state.text[state.emitted : upto]
        state.emitted = max(state.emitted, upto)
        return delta


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """Earliest stop string in ``text[start:]`` (a match may begin before ``start``)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
