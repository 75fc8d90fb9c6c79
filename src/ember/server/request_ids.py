"""Request ids: the client's ``X-Request-ID`` when it is a reasonable token, and engine ids.

A client id is echoed in a header and written into every log line, so it
must be a short token: letters, digits and ``._:-``, 1 to 128 characters
(UUIDs, ULIDs, trace ids and ``svc:1234.5`` styles all fit). Anything else
(too long, spaces, control characters, non-ASCII) is replaced by a generated
id rather than refused: the request itself is fine.

Clients reuse ids (retries, a fixed id in a script, two tabs), so the id
handed to the engine is the client's id plus a per-process sequence number:
two requests in flight can never share an engine stream.
"""

from __future__ import annotations

import itertools
import re
import uuid

_TOKEN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_engine_seq = itertools.count(1)


def client_request_id(value: str | None) -> str:
    """``value`` if it is an acceptable request id, else a new one (32 hex digits)."""
    if value is not None and _TOKEN.fullmatch(value):
        return value
    return uuid.uuid4().hex


def engine_request_id(request_id: str) -> str:
    """An engine request id unique within this process, that still names the client's id."""
    return f"{request_id}#{next(_engine_seq)}"
