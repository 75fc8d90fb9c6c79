"""``ember serve --ray``: the Ray Serve options of ``ember serve`` (defaults from ``RayConfig``).

Registered on the ``serve`` parser by ``ember.server.cli``; importing this
module does not import Ray, so ``ember serve`` without ``--ray`` never needs it.
"""

from __future__ import annotations

import argparse

from ember.ray.config import RayConfig, RayConfigError

_R = RayConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Ray Serve (pip install 'ember[ray]'; see README \"Past one machine\")")
    g.add_argument("--ray", action="store_true", help="serve as a Ray Serve application: --host/--port are Ray Serve's HTTP proxy")
    g.add_argument(
        "--ray-address",
        default=_R.address,
        metavar="ADDR",
        help="existing Ray cluster to deploy on ('auto', host:6379, ray://host:10001); default: a local single-node instance on loopback",
    )
    g.add_argument("--app-name", default=_R.app_name, help="Ray Serve application name")
    g.add_argument("--replicas", type=int, default=_R.replicas, help="replicas, each with its own engine (without autoscaling)")
    g.add_argument("--min-replicas", type=int, default=_R.min_replicas, help="autoscaling: fewest replicas")
    g.add_argument("--max-replicas", type=int, default=_R.max_replicas, help="autoscaling: most replicas (setting it turns autoscaling on)")
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=_R.target_ongoing_requests,
        help="autoscaling: in-flight requests per replica to aim for",
    )
    g.add_argument(
        "--upscale-delay",
        type=float,
        default=_R.upscale_delay_s,
        help="autoscaling: seconds the load must ask for more replicas before one is added",
    )
    g.add_argument(
        "--downscale-delay",
        type=float,
        default=_R.downscale_delay_s,
        help="autoscaling: seconds the load must ask for fewer before one is drained and removed",
    )
    g.add_argument(
        "--num-cpus-per-replica",
        type=float,
        default=None,
        help="Ray CPUs one replica reserves (default: --threads, at least 1): reserve the cores its engine computes on",
    )
    g.add_argument("--num-gpus-per-replica", type=float, default=_R.num_gpus, help="Ray GPUs one replica reserves (with --device cuda)")
    g.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=_R.max_ongoing_requests,
        help="requests Ray sends one replica at once (default: --max-running + --max-queue)",
    )
    g.add_argument("--ingress-replicas", type=int, default=_R.ingress_replicas, help="replicas of the light front deployment that routes")
    g.add_argument(
        "--load-epsilon", type=float, default=_R.load_epsilon, help="session routing: a replica may hold (1 + epsilon) x the mean load"
    )
    g.add_argument(
        "--load-floor", type=int, default=_R.load_floor, metavar="N", help="session routing: ... unless it holds fewer than N requests"
    )
    g.add_argument("--max-attempts", type=int, default=_R.max_attempts, help="replicas tried per request before its first byte")
    g.add_argument(
        "--metrics-port",
        type=int,
        default=_R.metrics_port,
        help="each replica also serves Prometheus /metrics on this port + its rank on the node (0, 1, ...)",
    )


def ray_config_from_args(args: argparse.Namespace) -> RayConfig:
    """The RayConfig of parsed ``ember serve`` arguments; raises ``RayConfigError`` for what cannot run under Ray."""
    for flag, value in (("--http2", args.http2), ("--grpc-port", args.grpc_port), ("--ssl-certfile", args.ssl_certfile)):
        if value:
            raise RayConfigError(f"{flag} is not available with --ray: Ray Serve's proxy serves HTTP.")
    num_cpus = args.num_cpus_per_replica if args.num_cpus_per_replica is not None else max(1, args.threads)
    config = RayConfig(
        app_name=args.app_name,
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        upscale_delay_s=args.upscale_delay,
        downscale_delay_s=args.downscale_delay,
        num_cpus=num_cpus,
        num_gpus=args.num_gpus_per_replica,
        max_ongoing_requests=args.max_ongoing_requests,
        ingress_replicas=args.ingress_replicas,
        load_epsilon=args.load_epsilon,
        load_floor=args.load_floor,
        max_attempts=args.max_attempts,
        metrics_port=args.metrics_port,
        address=args.ray_address,
    )
    config.validate()
    return config
