"""RayConfig: how Ember runs as a Ray Serve application (``ember serve --ray``).

The engine and server options are the ``ember serve`` ones (``ServerConfig``,
``EngineConfig``, ``SessionConfig``), passed to every replica unchanged. This
file holds what only the Ray deployment needs, with its defaults, and turns it
into Ray Serve deployment options (``replica_options``), a pure function of
the configs. Importing it does not import Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.config import ServerConfig
from ember.router.config import RouterConfig

_ROUTER = RouterConfig()  # the session policy's defaults are ember route's

# Dotted paths Ray Serve imports in every process that routes or autoscales.
ROUTER_CLASS = "ember.ray.router:SessionAffinityRouter"
AUTOSCALING_POLICY = "ember.ray.autoscale:EmberAutoscalingPolicy"


class RayConfigError(ValueError):
    """An inconsistent combination of options."""


@dataclass(frozen=True)
class RayConfig:
    """Options of the Ray Serve deployment; every field documents its unit in its name.

    Autoscaling is on when ``max_replicas`` is set: Ray Serve then keeps
    between ``min_replicas`` and ``max_replicas`` replicas, decided by
    ``ember.ray.autoscale`` from each replica's in-flight requests, admission
    queue and TTFT. Otherwise ``replicas`` is fixed.
    """

    app_name: str = "ember"
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int | None = None
    # In-flight requests per replica the autoscaler aims for.
    target_ongoing_requests: float = 8.0
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 120.0
    # How often each replica reports its load to the autoscaler, and over how long it is averaged.
    autoscale_interval_s: float = 2.0
    autoscale_look_back_s: float = 10.0
    # Ray resources one replica reserves. One engine runs ``EngineConfig.threads``
    # compute threads: reserve as many CPUs, or replicas on a node fight for cores.
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # Requests Ray Serve sends one replica at once; None: the replica's own
    # admission capacity (max_running + max_queue), so that overload is answered
    # by Ember's admission control (429 + Retry-After) rather than queued in Ray.
    max_ongoing_requests: int | None = None
    # Replicas of the light front deployment that reads bodies and routes (no engine, no CPU reserved).
    ingress_replicas: int = 1
    # The session policy (router/policy.py), as in ``ember route``.
    load_epsilon: float = _ROUTER.load_epsilon
    load_floor: int = _ROUTER.load_floor
    session_prompt_chars: int = _ROUTER.session_prompt_chars
    # Tries per request before the first byte reaches the client (a replica that died meanwhile is skipped).
    max_attempts: int = 3
    # Each replica serves its own Prometheus /metrics on metrics_port + its rank on
    # the node (0, 1, ...). None: only the application's /metrics (one replica's).
    metrics_port: int | None = None
    # An existing Ray cluster ("auto", "ray://host:10001", "host:6379"); None starts a local instance.
    address: str | None = None

    def validate(self) -> None:
        if self.replicas < 1:
            raise RayConfigError("--replicas must be >= 1.")
        if self.max_replicas is not None and not 1 <= self.min_replicas <= self.max_replicas:
            raise RayConfigError("autoscaling needs 1 <= --min-replicas <= --max-replicas.")
        if self.target_ongoing_requests <= 0:
            raise RayConfigError("--target-ongoing-requests must be > 0.")
        if self.max_attempts < 1:
            raise RayConfigError("--max-attempts must be >= 1.")
        if self.load_epsilon < 0 or self.load_floor < 1:
            raise RayConfigError("--load-epsilon must be >= 0 and --load-floor >= 1.")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None


def replica_options(ray: RayConfig, server: ServerConfig) -> dict[str, Any]:
    """Keyword arguments of ``EmberReplica.options(...)``: scale, resources, routing, drain.

    Scale-down drains: Ray Serve stops routing to a replica it removes, then
    waits up to ``graceful_shutdown_timeout_s`` (the server's drain timeout)
    for its in-flight requests, streams included, before it stops the engine.
    """
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": ray.num_cpus, "num_gpus": ray.num_gpus},
        "max_ongoing_requests": ray.max_ongoing_requests or server.max_running + server.max_queue,
        "graceful_shutdown_timeout_s": server.drain_timeout_s,
        "graceful_shutdown_wait_loop_s": 0.5,
        # Model load and warm-up happen in the constructor: allow for a slow disk.
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        "request_router_config": {
            "request_router_class": ROUTER_CLASS,
            "request_router_kwargs": {
                "load_epsilon": ray.load_epsilon,
                "load_floor": ray.load_floor,
                "session_prompt_chars": ray.session_prompt_chars,
            },
        },
    }
    if ray.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": ray.min_replicas,
            "max_replicas": ray.max_replicas,
            "initial_replicas": ray.min_replicas,
            "target_ongoing_requests": ray.target_ongoing_requests,
            "upscale_delay_s": ray.upscale_delay_s,
            "downscale_delay_s": ray.downscale_delay_s,
            "metrics_interval_s": ray.autoscale_interval_s,
            "look_back_period_s": ray.autoscale_look_back_s,
            "policy": {
                "policy_function": AUTOSCALING_POLICY,
                "policy_kwargs": {"ttft_slo_s": server.slo_ttft_p99_s},
            },
        }
    else:
        options["num_replicas"] = ray.replicas
    return options


def ingress_options(ray: RayConfig) -> dict[str, Any]:
    """Keyword arguments of ``EmberIngress.options(...)``: it only relays, so it reserves no CPU."""
    return {
        "num_replicas": ray.ingress_replicas,
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": 10_000,
    }
