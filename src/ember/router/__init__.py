"""Ember router: one OpenAI-compatible endpoint in front of several replicas.

It keeps a conversation on the replica that holds its cache (rendezvous hashing
with bounded load), balances the rest (power of two choices), probes replicas,
opens a circuit breaker on failing ones and fails over before the first byte.

Public API: ``RouterConfig``, ``create_router_app``, and the pure routing
policy (``ReplicaSnapshot``, ``RouteDecision``, ``choose``, ``rendezvous_order``).
"""

from ember.router.app import create_router_app
from ember.router.breaker import BreakerState, CircuitBreaker
from ember.router.config import RouterConfig, RouterConfigError
from ember.router.policy import ReplicaSnapshot, RouteDecision, choose, rendezvous_order

__all__ = [
    "BreakerState",
    "CircuitBreaker",
    "ReplicaSnapshot",
    "RouteDecision",
    "RouterConfig",
    "RouterConfigError",
    "choose",
    "create_router_app",
    "rendezvous_order",
]
