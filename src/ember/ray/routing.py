"""The session router's decisions, as pure functions (no Ray): which key, which replicas in which order.

``SessionAffinityRouter`` (router.py) hands these a snapshot of its replicas:
their ids and the requests in flight on each (Ray Serve's cached queue
length: what the replica last reported, plus what this router sent since). The order itself is
``router/policy.py``'s ``session`` policy, the one ``ember route`` uses:
rendezvous hashing of the session key over replica ids, with bounded load.
Ray Serve then takes the first replica of that order that has room
(``max_ongoing_requests``): a conversation moves only when its home is gone,
saturated or over the load bound, and then always to the same next replica.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ember.router.policy import ReplicaSnapshot, RouteDecision, choose
from ember.router.session_key import key_from_body


def call_session_key(session_id: str, args: Sequence[Any], prompt_chars: int) -> str | None:
    """The session key of one deployment call.

    ``session_id`` is the handle's ``session_id`` option: the ingress sets it
    to the key ``ember route`` would derive from the HTTP request (header,
    path, body). A Ray-native caller may set it too; when it does not, and the
    call's first argument is an OpenAI request body (a dict), the key comes
    from that body (``session_id``, ``user``, the conversation's opening).
    """
    if session_id:
        return session_id
    if args and isinstance(args[0], dict):
        return key_from_body(args[0], prompt_chars)
    return None


def replica_order(
    session_key: str | None,
    outstanding: Mapping[str, int],
    *,
    load_epsilon: float,
    load_floor: int,
    tick: int,
) -> RouteDecision:
    """Replica ids best first, for a request with ``session_key``.

    ``outstanding`` maps every routable replica id to its requests in flight. With a key: its rendezvous order, replicas over the
    load bound last. Without: power of two choices on load (``tick`` draws).
    """
    snapshots = [ReplicaSnapshot(url=replica_id, in_flight=load) for replica_id, load in outstanding.items()]
    return choose("session", snapshots, session_key=session_key, load_epsilon=load_epsilon, load_floor=load_floor, tick=tick)
