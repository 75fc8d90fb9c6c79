"""Autoscaling on Ember's own signals: in-flight requests, the admission queue, TTFT.

Every replica reports ``record_autoscaling_stats()`` (see ``replica.py``):
its in-flight requests (``IN_FLIGHT``: admitted or waiting, as the server
counts them), requests waiting in Ember's admission queue (``WAITING``) and
its windowed TTFT p99 (``TTFT_P99_S``). Ray Serve averages each over the
look-back period and calls ``EmberAutoscalingPolicy`` on its controller.

``desired_replicas`` is the decision, a pure function. Ray Serve applies
``min_replicas``/``max_replicas`` and the up/down delays around it, so a
short burst does not add a replica and a short lull does not remove one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

IN_FLIGHT = "ember_in_flight"
WAITING = "ember_admission_waiting"
TTFT_P99_S = "ember_ttft_p99_s"


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's averaged signals."""

    in_flight: float = 0.0
    waiting: float = 0.0
    ttft_p99_s: float = 0.0


def desired_replicas(loads: list[ReplicaLoad], current: int, *, target_ongoing_requests: float, ttft_slo_s: float | None) -> int:
    """How many replicas the load asks for, before Ray's bounds and delays.

    - ``ceil(total in-flight / target_ongoing_requests)``: enough replicas for
      each to hold its target share;
    - at least one more than ``current`` while any replica queues requests in
      admission (it is full: the in-flight count understates the demand) or its
      TTFT p99 is over ``ttft_slo_s``.
    """
    by_load = math.ceil(sum(load.in_flight for load in loads) / target_ongoing_requests)
    pressed = any(load.waiting >= 1.0 for load in loads) or (ttft_slo_s is not None and any(load.ttft_p99_s > ttft_slo_s for load in loads))
    return max(by_load, current + 1) if pressed else by_load


def loads_from_metrics(metrics: Mapping[str, Mapping[Any, float]] | None) -> list[ReplicaLoad]:
    """Per-replica loads from Ray's ``{metric: {replica_id: value}}`` (replicas missing a metric read 0)."""
    metrics = metrics or {}
    replica_ids = {rid for values in metrics.values() for rid in values}
    return [
        ReplicaLoad(
            in_flight=float(metrics.get(IN_FLIGHT, {}).get(rid, 0.0)),
            waiting=float(metrics.get(WAITING, {}).get(rid, 0.0)),
            ttft_p99_s=float(metrics.get(TTFT_P99_S, {}).get(rid, 0.0)),
        )
        for rid in replica_ids
    ]


class EmberAutoscalingPolicy:
    """Ray Serve's custom autoscaling policy (``AutoscalingConfig.policy``), built once per deployment.

    Until replicas have reported Ember's metrics (just after a deploy), Ray's
    own count of ongoing requests stands in for the in-flight total.
    """

    def __init__(self, ttft_slo_s: float | None = None) -> None:
        self.ttft_slo_s = ttft_slo_s

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        loads = loads_from_metrics(ctx.aggregated_metrics)
        if not loads:
            loads = [ReplicaLoad(in_flight=float(ctx.total_num_requests))]
        target = ctx.config.get_target_ongoing_requests() if ctx.config is not None else 1.0
        desired = desired_replicas(loads, ctx.current_num_replicas, target_ongoing_requests=target, ttft_slo_s=self.ttft_slo_s)
        return desired, ctx.policy_state
