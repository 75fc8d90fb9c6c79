"""Autoscaling on Ember's signals, and the deployment options, as pure functions (no Ray cluster)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ember.config import ServerConfig
from ember.ray.autoscale import IN_FLIGHT, TTFT_P99_S, WAITING, EmberAutoscalingPolicy, ReplicaLoad, desired_replicas, loads_from_metrics
from ember.ray.config import AUTOSCALING_POLICY, ROUTER_CLASS, RayConfig, RayConfigError, replica_options


def desired(loads: list[ReplicaLoad], current: int, ttft_slo_s: float | None = None) -> int:
    return desired_replicas(loads, current, target_ongoing_requests=8, ttft_slo_s=ttft_slo_s)


@pytest.mark.timeout(10)
def test_replicas_follow_in_flight_requests_over_the_target() -> None:
    assert desired([ReplicaLoad(in_flight=20), ReplicaLoad(in_flight=19)], current=2) == 5  # ceil(39 / 8)
    assert desired([ReplicaLoad(in_flight=3), ReplicaLoad(in_flight=2)], current=2) == 1
    assert desired([ReplicaLoad(), ReplicaLoad()], current=2) == 0  # Ray's min_replicas bounds it


@pytest.mark.timeout(10)
def test_queueing_in_admission_or_a_slow_ttft_asks_for_one_more_replica() -> None:
    light = ReplicaLoad(in_flight=4)
    assert desired([light, ReplicaLoad(in_flight=4, waiting=3)], current=2) == 3
    assert desired([light, ReplicaLoad(in_flight=4, ttft_p99_s=1.5)], current=2, ttft_slo_s=1.0) == 3
    assert desired([light, ReplicaLoad(in_flight=4, ttft_p99_s=1.5)], current=2, ttft_slo_s=None) == 1
    # When the load alone asks for more, pressure does not lower it.
    assert desired([ReplicaLoad(in_flight=40, waiting=5)], current=1) == 5


@pytest.mark.timeout(10)
def test_the_policy_reads_rays_aggregated_metrics_and_falls_back_to_rays_count() -> None:
    metrics = {IN_FLIGHT: {"r1": 12.0, "r2": 10.0}, WAITING: {"r1": 0.0, "r2": 0.0}, TTFT_P99_S: {"r1": 0.2}}
    loads = sorted(loads_from_metrics(metrics), key=lambda load: load.in_flight)
    assert loads == [ReplicaLoad(10.0, 0.0, 0.0), ReplicaLoad(12.0, 0.0, 0.2)]
    config = SimpleNamespace(get_target_ongoing_requests=lambda: 8.0)
    policy = EmberAutoscalingPolicy(ttft_slo_s=None)
    ctx = SimpleNamespace(aggregated_metrics=metrics, total_num_requests=0.0, current_num_replicas=2, config=config, policy_state={})
    assert policy(ctx) == (3, {})
    fresh = SimpleNamespace(aggregated_metrics={}, total_num_requests=17.0, current_num_replicas=1, config=config, policy_state={})
    assert policy(fresh)[0] == 3


@pytest.mark.timeout(10)
def test_replica_options_fixed_scale_and_routing() -> None:
    server = ServerConfig(max_running=32, max_queue=64, drain_timeout_s=30)
    options = replica_options(RayConfig(replicas=2, num_cpus=1), server)
    assert options["num_replicas"] == 2 and "autoscaling_config" not in options
    assert options["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0.0}
    # Ray never queues in front of Ember's admission control...
    assert options["max_ongoing_requests"] == 96
    # ... and drains a replica it removes for as long as `ember serve` drains.
    assert options["graceful_shutdown_timeout_s"] == 30
    router = options["request_router_config"]
    assert router["request_router_class"] == ROUTER_CLASS
    assert router["request_router_kwargs"]["load_floor"] == RayConfig().load_floor


@pytest.mark.timeout(10)
def test_replica_options_autoscaling() -> None:
    ray = RayConfig(min_replicas=1, max_replicas=4, upscale_delay_s=5, downscale_delay_s=60, target_ongoing_requests=6)
    options = replica_options(ray, ServerConfig(slo_ttft_p99_s=0.8))
    scaling = options["autoscaling_config"]
    assert "num_replicas" not in options
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["initial_replicas"]) == (1, 4, 1)
    assert (scaling["upscale_delay_s"], scaling["downscale_delay_s"], scaling["target_ongoing_requests"]) == (5, 60, 6)
    assert scaling["policy"] == {"policy_function": AUTOSCALING_POLICY, "policy_kwargs": {"ttft_slo_s": 0.8}}


@pytest.mark.timeout(10)
def test_the_ray_config_rejects_what_cannot_run() -> None:
    for bad in (RayConfig(replicas=0), RayConfig(min_replicas=3, max_replicas=2), RayConfig(load_floor=0), RayConfig(max_attempts=0)):
        with pytest.raises(RayConfigError):
            bad.validate()


@pytest.mark.timeout(30)
def test_serve_run_arguments_are_the_ember_serve_options() -> None:
    from ember.ray.app import _parse_serve_args
    from ember.ray.cli import ray_config_from_args
    from ember.server.cli import configs_from_args

    args = _parse_serve_args({"replicas": "3", "threads": "1", "session_dir": "/tmp/s", "no-sessions": "true", "max-replicas": "5"})
    server, engine, sessions = configs_from_args(args)
    ray = ray_config_from_args(args)
    assert (ray.replicas, ray.max_replicas, ray.num_cpus) == (3, 5, 1)
    assert engine.threads == 1 and sessions.session_dir == "/tmp/s" and not sessions.enabled


@pytest.mark.timeout(30)
def test_ember_serve_ray_refuses_options_rays_proxy_cannot_serve() -> None:
    from ember.ray.app import _parse_serve_args
    from ember.ray.cli import ray_config_from_args

    with pytest.raises(RayConfigError, match="--grpc-port"):
        ray_config_from_args(_parse_serve_args({"grpc-port": "50051"}))


@pytest.mark.timeout(60)
def test_serve_runs_app_builder_binds_both_deployments_with_valid_ray_options() -> None:
    pytest.importorskip("ray", reason="ember[ray] is part of make test")
    from ember.ray.app import app_builder

    # Ray Serve validates the options (autoscaling policy, router config) when they are bound.
    app = app_builder({"replicas": "2", "threads": "1", "max-replicas": "3", "upscale-delay": "1"})
    assert type(app).__name__ == "Application"
