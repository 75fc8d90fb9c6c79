"""Router configuration: the one home of the router's defaults.

``ember route`` reads its defaults and help texts from ``RouterConfig``. The
upstream list may also come from a JSON or TOML file that is reloaded while the
router runs (``UpstreamsFile``). Every duration is in seconds (``_s``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from ember.errors import EmberError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: JSON upstreams files only
    tomllib = None  # type: ignore[assignment]

PolicyName = Literal["session", "least-load", "round-robin"]
POLICY_NAMES: tuple[PolicyName, ...] = ("session", "least-load", "round-robin")


class RouterConfigError(EmberError, ValueError):
    """A router option or upstreams file is invalid; the message says which and why."""


@dataclass(frozen=True)
class RouterConfig:
    """Options of one router process (``ember route``)."""

    # Base URLs of the replicas, e.g. ``http://10.0.0.5:8000``. A trailing ``/v1``
    # is accepted and dropped: the router forwards the client's ``/v1/...`` path.
    upstreams: tuple[str, ...] = ()
    # JSON or TOML file with more upstreams; reloaded on SIGHUP or when its mtime changes.
    config_file: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    policy: PolicyName = "session"
    # Bounded load: a replica takes a new request only while its load stays within
    # (1 + load_epsilon) x the mean load. 0 = strict balance, large = pure affinity.
    load_epsilon: float = 0.25
    # ... unless it holds fewer than load_floor requests: below that a replica keeps
    # its sessions whatever the mean. Moving a conversation costs a prefill of its
    # whole history; one more sequence in a continuous batch costs far less.
    load_floor: int = 4
    # Active health checks: GET {upstream}/ready every probe_interval_s.
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 1.0
    # Circuit breaker: this many consecutive failures open it for breaker_open_s,
    # then one trial request decides between closed and open again.
    breaker_failures: int = 5
    breaker_open_s: float = 10.0
    # Whole-request deadline (a client's X-Request-Timeout can only shorten it).
    # Above the replicas' own default (10 s) so the replica, not the router, times out first.
    request_timeout_s: float = 60.0
    connect_timeout_s: float = 2.0
    # Longest silence tolerated from an upstream, before the first byte and
    # between chunks. Before the first byte a stall fails over to another replica.
    stall_timeout_s: float = 30.0
    # Replicas tried per request (the first one included).
    max_attempts: int = 3
    # Retry-After (seconds) sent with the router's own 502/503 answers.
    retry_after_s: int = 1
    max_body_bytes: int = 4 * 1024 * 1024
    # Without a session id, a completion prompt's first this-many characters
    # name its conversation (a chat uses its system + first user message).
    session_prompt_chars: int = 1024
    # Protects /admin/*. Without it, /admin/* answers loopback clients only.
    admin_key: str | None = None
    # Send X-Ember-Upstream (the serving replica's URL) with every response. Handy
    # for debugging affinity; turn it off when clients must not learn replica addresses.
    expose_upstream: bool = True
    # Shared upstream connection pool (keep-alive).
    max_connections: int = 1024
    max_keepalive_connections: int = 256
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise RouterConfigError(f"Unknown policy {self.policy!r}; choose one of {', '.join(POLICY_NAMES)}.")
        if self.load_epsilon < 0:
            raise RouterConfigError("load_epsilon must be >= 0.")
        if self.load_floor < 1:
            raise RouterConfigError("load_floor must be >= 1.")
        if self.breaker_failures < 1:
            raise RouterConfigError("breaker_failures must be >= 1.")
        if self.max_attempts < 1:
            raise RouterConfigError("max_attempts must be >= 1.")
        durations = ("probe_interval_s", "probe_timeout_s", "request_timeout_s", "connect_timeout_s", "stall_timeout_s")
        for name in durations:
            if getattr(self, name) <= 0:
                raise RouterConfigError(f"{name} must be > 0.")
        # Canonical URLs make the same replica compare (and hash) equal however it was typed.
        object.__setattr__(self, "upstreams", tuple(dict.fromkeys(normalize_upstream_url(u) for u in self.upstreams)))


def normalize_upstream_url(url: str) -> str:
    """Return the canonical base URL of an upstream: ``scheme://host[:port][/prefix]``.

    Trailing slashes and a trailing ``/v1`` are dropped, so ``http://h:8000/v1/``
    and ``http://h:8000`` name the same replica (rendezvous hashing relies on it).
    """
    text = url.strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise RouterConfigError(f"Upstream {url!r} is not an http(s) URL like http://127.0.0.1:8000.")
    if parts.query or parts.fragment:
        raise RouterConfigError(f"Upstream {url!r} must not carry a query or fragment.")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc.lower()}{path}"


def parse_upstreams_file(text: str, *, toml: bool) -> tuple[str, ...]:
    """Parse the upstream list of a config file.

    Accepted shapes: JSON ``["http://a", ...]`` or ``{"upstreams": [...]}``; TOML
    ``upstreams = ["http://a", ...]`` or ``[[upstreams]]`` tables with ``url``.
    Entries may be strings or objects with a ``url`` field.
    """
    if toml and tomllib is None:
        raise RouterConfigError("TOML upstreams files need Python 3.11 or later; use JSON.")
    try:
        data = tomllib.loads(text) if toml else json.loads(text)
    except ValueError as exc:  # both JSONDecodeError and TOMLDecodeError are ValueErrors
        raise RouterConfigError(f"Upstreams file is not valid {'TOML' if toml else 'JSON'}: {exc}") from exc
    entries = data.get("upstreams") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise RouterConfigError("Upstreams file must hold a list of URLs, or an 'upstreams' list.")
    urls: list[str] = []
    for entry in entries:
        url = entry.get("url") if isinstance(entry, dict) else entry
        if not isinstance(url, str):
            raise RouterConfigError(f"Upstream entry {entry!r} is neither a URL string nor an object with 'url'.")
        urls.append(normalize_upstream_url(url))
    return tuple(dict.fromkeys(urls))


class UpstreamsFile:
    """An upstreams file on disk that notices its own changes.

    ``changed()`` compares the file's (mtime, size) with the last ``load()``;
    the router polls it on every probe tick and also reloads on SIGHUP.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._loaded_stamp: tuple[int, int] | None = None

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def changed(self) -> bool:
        """True when the file differs from what ``load()`` last read."""
        return self._stamp() != self._loaded_stamp

    def load(self) -> tuple[str, ...]:
        """Read and parse the file; raises ``RouterConfigError`` if it is missing or invalid."""
        # Stamp first: an edit racing with the read shows up as a change next tick.
        self._loaded_stamp = self._stamp()
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise RouterConfigError(f"Cannot read upstreams file {self.path}: {exc}") from exc
        return parse_upstreams_file(text, toml=self.path.endswith(".toml"))
