"""The Ray Serve application: ``build_app``, ``app_builder`` for ``serve run``, and ``ember serve --ray``.

Two deployments: ``EmberIngress`` (the HTTP entry point; routes by session)
in front of ``EmberReplica`` (one engine per replica). Three ways to run it:

- ``ember serve --ray --replicas 2 ...``: one command; a local single-node Ray
  instance (every Ray service on loopback), or ``--ray-address`` for a cluster;
- ``serve run ember.ray.app:app_builder replicas=2 threads=1 ...``: Ray's CLI,
  with the ``ember serve`` options as ``key=value`` (``no-sessions=true`` for a flag);
- ``serve.run(build_app(...))`` from Python.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from typing import Any

from ember.config import EngineConfig, ServerConfig, SessionConfig
from ember.ray.config import RayConfig, ingress_options, replica_options

log = logging.getLogger("ember.ray")

# Settings of a local instance, read by every Ray process when it first imports
# Ray: one machine, so every Ray service on loopback; replicas at normal priority
# (Ray lowers its workers' by default), as ``ember serve`` runs; and Ray Serve's
# throughput-optimized data path (user code and routers on the replica's own
# event loop, gRPC between deployments): measured here, the proxy's share of
# a request's latency drops from about 17-30 ms to 13 ms (README, "Past one machine").
LOCAL_INSTANCE_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_worker_niceness": "0",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
}


def build_app(server: ServerConfig, engine: EngineConfig, sessions: SessionConfig, ray_config: RayConfig) -> Any:
    """The bound Ray Serve application (a ``ray.serve.Application``)."""
    from ember.ray.ingress import EmberIngress
    from ember.ray.replica import EmberReplica

    ray_config.validate()
    # @serve.deployment makes the classes Deployments, which Ray's annotations do not tell type checkers.
    replicas = EmberReplica.options(**replica_options(ray_config, server)).bind(server, engine, sessions, ray_config)  # type: ignore[attr-defined]
    return EmberIngress.options(**ingress_options(ray_config)).bind(replicas, ray_config, server.max_body_bytes)  # type: ignore[attr-defined]


def app_builder(args: dict[str, str]) -> Any:
    """``serve run ember.ray.app:app_builder key=value ...``: the ``ember serve`` options, without dashes."""
    from ember.ray.cli import ray_config_from_args
    from ember.server.cli import configs_from_args

    parsed = _parse_serve_args(args)
    return build_app(*configs_from_args(parsed), ray_config_from_args(parsed))


def _parse_serve_args(args: dict[str, str]) -> argparse.Namespace:
    from ember.server.cli import register

    parser = argparse.ArgumentParser(prog="ember")
    register(parser.add_subparsers(dest="command"))
    argv = ["serve", "--ray"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value.lower() in ("true", ""):
            argv.append(flag)
        elif value.lower() != "false":
            argv += [flag, value]
    return parser.parse_args(argv)


def serve_on_ray(server: ServerConfig, engine: EngineConfig, sessions: SessionConfig, ray_config: RayConfig) -> int:
    """Deploy on Ray and block until SIGTERM or Ctrl-C; then delete the application (its replicas drain)."""
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    local = ray_config.address is None
    if local:
        for name, value in LOCAL_INSTANCE_ENV.items():
            os.environ.setdefault(name, value)
    import ray
    from ray import serve

    app = build_app(server, engine, sessions, ray_config)
    if local:
        ray.init(include_dashboard=False)
    else:
        ray.init(address=ray_config.address)
    # Tests and scripts connect a driver to a local instance with this address.
    print(f"Ray: {'started a local instance' if local else 'connected to'} at {ray.get_runtime_context().gcs_address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve.start(http_options={"host": server.host, "port": server.port})
    serve.run(app, name=ray_config.app_name, route_prefix="/", blocking=False)
    scale = (
        f"{ray_config.min_replicas}-{ray_config.max_replicas} replicas (autoscaling)"
        if ray_config.autoscaling
        else f"{ray_config.replicas} replica(s)"
    )
    print(f"Ember on Ray Serve: http://{server.host}:{server.port}/v1, {scale}, application '{ray_config.app_name}'", flush=True)
    stop.wait()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)  # a second signal ends the process at once
    log.info("stopping: replicas finish their in-flight requests (up to %.0fs)", server.drain_timeout_s)
    serve.delete(ray_config.app_name)
    if local:
        serve.shutdown()
        ray.shutdown()
    return 0
