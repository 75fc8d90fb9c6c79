"""The token ids each conversation's last turn ended with, readable from any thread.

Re-tokenizing the previous answer can give other ids than the ones the model
produced (BPE is not unique), which would cut prefix reuse at the first
difference. So a new turn whose rendered prompt extends the session's text
exactly keeps the session's ids and encodes only the rest (``prompt_ids``,
called by the server on its event loop while the engine thread publishes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class SessionIds:
    """key -> (ids, their decoded text, computed on first use); every access under one small lock."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._entries: dict[str, tuple[list[int], str | None]] = {}
        self._lock = threading.Lock()

    def publish(self, key: str, ids: list[int]) -> None:
        with self._lock:
            self._entries[key] = (ids, None)

    def forget(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def prompt_ids(self, key: str, rendered: str, encode: Callable[[str], list[int]]) -> list[int] | None:
        """The session's ids plus ``encode`` of the rest, when ``rendered`` extends the session's text; else None."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return None
        ids, text = entry
        if text is None:
            text = self._decode(ids)  # outside the lock: the engine thread never waits for it
            with self._lock:
                if self._entries.get(key, (None, None))[0] is ids:
                    self._entries[key] = (ids, text)
        if not text or not rendered.startswith(text):
            return None
        return ids + encode(rendered[len(text) :])
