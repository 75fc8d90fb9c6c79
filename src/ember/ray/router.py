"""SessionAffinityRouter: Ray Serve's request router for Ember replicas.

Ray Serve runs one instance in every process that holds a handle to the
``EmberReplica`` deployment (the ingress replicas, a Ray-native caller). For
each request it calls ``choose_replicas``; this router answers with every
replica in ``routing.replica_order``, one per rank. Ray Serve tries the ranks
in order and takes the first replica with room under its
``max_ongoing_requests`` (probing it when its queue length is not cached), so:

- every turn of a conversation lands on its home replica;
- past the load bound, or when the home is full, on its next-ranked replica;
- a dead replica is dropped from the set (Ray tells the router), and its
  conversations go to their next-ranked replica, which restores them warm
  from the shared ``--session-dir``.

Replicas are named by their Ray replica id, stable for a replica's life. A
replacement replica has a new id: it takes about 1/n of the keys, as a joining
replica does in ``ember route``.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from ember.ray.routing import call_session_key, replica_order
from ember.router.config import RouterConfig

_DEFAULTS = RouterConfig()


class SessionAffinityRouter(RequestRouter):
    """Rendezvous hashing with bounded load over the replicas' Ray ids (see module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        """Options from ``RequestRouterConfig.request_router_kwargs`` (see ``ember.ray.config``)."""
        self._load_epsilon = float(kwargs.get("load_epsilon", _DEFAULTS.load_epsilon))
        self._load_floor = int(kwargs.get("load_floor", _DEFAULTS.load_floor))
        self._prompt_chars = int(kwargs.get("session_prompt_chars", _DEFAULTS.session_prompt_chars))
        self._tick = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = None
        if pending_request is not None:
            # Back off between rounds when every replica is full, instead of spinning.
            pending_request.routing_context.should_backoff = True
            key = call_session_key(pending_request.metadata.session_id, pending_request.args, self._prompt_chars)
        cache = self.replica_queue_len_cache
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        outstanding = {replica_id: cache.get(replica.replica_id) or 0 for replica_id, replica in by_id.items()}
        self._tick += 1
        decision = replica_order(key, outstanding, load_epsilon=self._load_epsilon, load_floor=self._load_floor, tick=self._tick)
        return [[by_id[replica_id]] for replica_id in decision.candidates]
