"""Routing policies: pure functions from a snapshot of replica stats to an order of replicas.

Nothing here keeps state or reads a clock. The caller takes a snapshot of every
replica (``ReplicaSnapshot``), asks ``choose`` for a ``RouteDecision``, and tries
``decision.candidates`` in order (the first is the choice, the rest are the
failover order). The same inputs always give the same decision, so the policies
are tested exactly, without servers or randomness.

``session`` — rendezvous (highest-random-weight) hashing of the session key over
the replica URLs, with bounded load (and a load floor below which the bound
does not apply; see ``load_capacity``). Rendezvous hashing moves the fewest keys
when the set changes: a joining replica takes about 1/n of the keys (only keys
it now wins), a leaving one gives away only its own keys, each to that key's
next-ranked replica.

What happens to a session when its replica dies: its requests go to the key's
next-ranked replica (the same one for every router, and the same one on every
turn), which restores the session from the shared ``--session-dir``. When the
home replica is ready again the session moves back to it. The router keeps no
per-session table, so this costs nothing and survives router restarts; the
price is one more warm restore per moved session, and the replicas' KV caches
are keyed by token hashes, so a moved session is never wrong, only cold.

``least-load`` — power of two choices: of two replicas picked by ``tick``, the
less loaded one. ``round-robin`` — rotate by ``tick``; kept for comparison.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ember.router.config import PolicyName


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """What the policy knows about one replica at the moment of a decision.

    ``available`` is False while the replica is not ready (draining, unreachable)
    or its circuit breaker refuses traffic; such replicas are never candidates.
    ``in_flight`` is the number of requests the router has outstanding on it.
    """

    url: str
    available: bool = True
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The replicas to try, best first, and where the session key lives.

    ``home`` is the key's top-ranked replica among *all* replicas, available or
    not: the one that holds its cache. None when there is no session key.
    """

    candidates: tuple[str, ...]
    home: str | None = None

    @property
    def affinity_hit(self) -> bool | None:
        """True when the request goes to its session's home; None without a session."""
        if self.home is None:
            return None
        return bool(self.candidates) and self.candidates[0] == self.home


def rendezvous_order(key: str, urls: Sequence[str]) -> list[str]:
    """Replica URLs ranked for ``key`` by rendezvous hashing (best first).

    The rank of a URL depends only on (key, URL), never on the other URLs, which
    is what makes joins and leaves move the minimum number of keys.
    """
    prefix = key.encode("utf-8", "surrogatepass") + b"\x00"
    return sorted(urls, key=lambda url: _score(prefix, url), reverse=True)


def _score(prefix: bytes, url: str) -> int:
    digest = hashlib.blake2b(prefix + url.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def load_capacity(loads: Sequence[int], epsilon: float, floor: int = 1) -> int:
    """The most requests one replica may hold after taking one more request.

    ``max(ceil((1 + epsilon) * (total + 1) / n), floor)``: the mean load
    including the new request, stretched by ``epsilon``, but never below
    ``floor``. Without the floor, a light load is "unbalanced" all the time:
    with 3 replicas and one request in flight the capacity is 1, so a second
    turn for the same replica moves its conversation away and recomputes its
    whole history elsewhere, to spare a replica one more sequence in its batch.
    Invariant: at least one replica is below the capacity
    (n * capacity >= total + 1 > total), so a bounded choice always exists.
    """
    return max(math.ceil((1.0 + epsilon) * (sum(loads) + 1) / len(loads)), floor)


def session_decision(key: str, replicas: Sequence[ReplicaSnapshot], epsilon: float, floor: int = 1) -> RouteDecision:
    """Rendezvous hashing with bounded load for one session key.

    Available replicas under the load capacity come first, in rendezvous order,
    then the overloaded ones (also in rendezvous order) as a last resort for
    failover. So the key stays on its home replica until that replica is more
    than (1 + epsilon) x the mean load and holds ``floor`` requests or more,
    and then spills to its next-ranked one.
    """
    ranked = rendezvous_order(key, [r.url for r in replicas])
    home = ranked[0] if ranked else None
    by_url = {r.url: r for r in replicas if r.available}
    if not by_url:
        return RouteDecision(candidates=(), home=home)
    capacity = load_capacity([r.in_flight for r in by_url.values()], epsilon, floor)
    under: list[str] = []
    over: list[str] = []
    for url in ranked:
        replica = by_url.get(url)
        if replica is not None:
            (under if replica.in_flight + 1 <= capacity else over).append(url)
    return RouteDecision(candidates=tuple(under + over), home=home)


def least_load_decision(replicas: Sequence[ReplicaSnapshot], tick: int) -> RouteDecision:
    """Power of two choices on in-flight requests.

    Two distinct available replicas are drawn from ``mix64(tick)``; the less
    loaded one (the first drawn on a tie) comes first, then all others by load.
    """
    available = [r for r in replicas if r.available]
    if len(available) < 2:
        return RouteDecision(candidates=tuple(r.url for r in available))
    n = len(available)
    draw = mix64(tick)
    first = draw % n
    second = (draw // n) % (n - 1)
    second += second >= first  # distinct from first
    a, b = available[first], available[second]
    winner = b if b.in_flight < a.in_flight else a
    rest = sorted((r for r in available if r is not winner), key=lambda r: r.in_flight)
    return RouteDecision(candidates=(winner.url, *(r.url for r in rest)))


def round_robin_decision(replicas: Sequence[ReplicaSnapshot], tick: int) -> RouteDecision:
    """The available replicas rotated by ``tick``: each one in turn goes first."""
    urls = [r.url for r in replicas if r.available]
    if not urls:
        return RouteDecision(candidates=())
    start = tick % len(urls)
    return RouteDecision(candidates=tuple(urls[start:] + urls[:start]))


def choose(
    policy: PolicyName,
    replicas: Sequence[ReplicaSnapshot],
    *,
    session_key: str | None,
    load_epsilon: float,
    tick: int,
    load_floor: int = 1,
) -> RouteDecision:
    """Decide where one request goes.

    ``tick`` is any integer that changes per request (the router's request
    counter); it drives round-robin and the power-of-two draw. ``load_floor``
    is the session policy's capacity floor (1: none). A ``session``
    request without a session key is routed like ``least-load``.
    """
    if policy == "session":
        if session_key is not None:
            return session_decision(session_key, replicas, load_epsilon, load_floor)
        return least_load_decision(replicas, tick)
    if policy == "least-load":
        return least_load_decision(replicas, tick)
    if policy == "round-robin":
        return round_robin_decision(replicas, tick)
    raise ValueError(f"unknown routing policy {policy!r}")


def mix64(value: int) -> int:
    """SplitMix64 finalizer: a well-spread 64-bit integer from any integer."""
    z = (value + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)
