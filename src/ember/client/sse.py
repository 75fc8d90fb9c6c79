"""Incremental parser of ``text/event-stream`` (Server-Sent Events) bytes.

Follows the WHATWG event-stream rules the client needs: lines end in LF, CRLF
or CR; ``data:`` lines accumulate (joined by LF) until a blank line dispatches
the event; lines starting with ``:`` are comments (keep-alives); one space after
the colon is dropped. Bytes arrive in arbitrary pieces, so a line or even a CRLF
pair may be split across ``feed`` calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE_END = re.compile(rb"\r\n|\r|\n")


@dataclass(frozen=True)
class ServerSentEvent:
    """One dispatched event: its ``data`` (lines joined by LF), ``event`` type and ``id``."""

    data: str
    event: str | None = None
    id: str | None = None


class SSEDecoder:
    """Turns a byte stream into ``ServerSentEvent``s.

    Invariant: ``_buffer`` never holds a complete line; ``_skip_lf`` is True when
    the previous piece ended in CR, so a leading LF of the next one belongs to
    that CRLF pair and is not an empty line.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._skip_lf = False
        self._data_lines: list[str] = []
        self._event: str | None = None
        self._id: str | None = None

    def feed(self, data: bytes) -> list[ServerSentEvent]:
        """Parse another piece of the stream; returns the events it completed."""
        events: list[ServerSentEvent] = []
        for line in self._split_lines(data):
            event = self._process_line(line)
            if event is not None:
                events.append(event)
        return events

    def _split_lines(self, data: bytes) -> list[str]:
        buffer = self._buffer
        buffer += data
        start = 0
        if self._skip_lf and buffer[:1] == b"\n":
            start = 1
        if buffer:
            self._skip_lf = False
        lines: list[str] = []
        for match in _LINE_END.finditer(buffer, start):
            # UTF-8 never uses CR or LF inside a multi-byte character, so lines decode alone.
            lines.append(buffer[start : match.start()].decode("utf-8", errors="replace"))
            start = match.end()
            self._skip_lf = match.group() == b"\r" and start == len(buffer)
        del buffer[:start]
        return lines

    def _process_line(self, line: str) -> ServerSentEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data_lines.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\0" not in value:
            self._id = value
        # "retry" and unknown fields are ignored: reconnection is the retry policy's job.
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        if not self._data_lines:
            self._event = None
            return None
        event = ServerSentEvent("\n".join(self._data_lines), self._event, self._id)
        self._data_lines = []
        self._event = None
        return event
