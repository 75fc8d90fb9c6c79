"""The router's long-lived parts and their background work: probes and config reloads.

``RouterService`` owns the replica set, the metrics, the one shared upstream
connection pool (keep-alive) with its HTTP client, and the proxy. It lives on
the event loop of the app that created it; call its methods from that loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import httpx

from ember.router.config import RouterConfig, RouterConfigError, UpstreamsFile
from ember.router.metrics import RouterMetrics
from ember.router.proxy import Proxy
from ember.router.replicas import Replica, ReplicaSet, probe

logger = logging.getLogger("ember.router")


class RouterService:
    """Replica set + metrics + HTTP client + proxy, and the probe loop that keeps them current."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        self.replicas = ReplicaSet(
            config.upstreams,
            breaker_failures=config.breaker_failures,
            breaker_open_s=config.breaker_open_s,
            clock=clock,
        )
        self.metrics = RouterMetrics(self.replicas)
        self.upstreams_file = UpstreamsFile(config.config_file) if config.config_file else None
        limits = httpx.Limits(
            max_connections=config.max_connections,
            max_keepalive_connections=config.max_keepalive_connections,
        )
        # One keep-alive connection pool for all upstream traffic. The proxy drives
        # it directly; probes and admin calls go through ``client``, built on it.
        self.pool = transport if transport is not None else httpx.AsyncHTTPTransport(limits=limits)
        # trust_env=False: proxy variables of the environment must not reroute replica traffic.
        self.client = httpx.AsyncClient(transport=self.pool, trust_env=False)
        self.proxy = Proxy(config, self.replicas, self.metrics, self.pool, clock)
        self._probe_loop_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[object]] = set()

    async def start(self) -> None:
        """Load the upstreams file, probe every replica once, then keep probing."""
        if self.upstreams_file is not None:
            self.reload_upstreams()
        await self.probe_all()
        self._probe_loop_task = asyncio.create_task(self._probe_loop())

    async def stop(self) -> None:
        """Stop background work and close the upstream connection pool (the client owns it)."""
        tasks = [*self._background, *([self._probe_loop_task] if self._probe_loop_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.aclose()

    async def probe_all(self) -> None:
        """Probe every replica's ``/ready`` concurrently."""
        await asyncio.gather(*(self.probe_one(replica) for replica in self.replicas))

    async def probe_one(self, replica: Replica) -> bool:
        ok = await probe(replica, self.client, self.config.probe_timeout_s)
        if not ok:
            self.metrics.probe_failed(replica.url)
        return ok

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            try:
                if self.upstreams_file is not None and self.upstreams_file.changed():
                    self.reload_upstreams()
                await self.probe_all()
            except Exception:  # the loop must outlive any one bad tick
                logger.exception("router probe tick failed")

    def add_upstream(self, url: str) -> tuple[Replica, bool]:
        """Add a replica at run time (URL normalized); returns (replica, newly added)."""
        known = self.replicas.get(url)
        if known is not None:
            return known, False
        return self.replicas.add(url), True

    def remove_upstream(self, url: str) -> bool:
        """Remove a replica at run time; its in-flight requests finish."""
        if not self.replicas.remove(url):
            return False
        self.metrics.forget_upstream(url)
        return True

    def reload_upstreams(self) -> bool:
        """Make the replica set the command-line upstreams plus the file's.

        The file wins over run-time admin changes: after a reload, the set is
        exactly command line + file. On an unreadable or invalid file the
        current set is kept and the error logged.
        """
        assert self.upstreams_file is not None
        try:
            from_file = self.upstreams_file.load()
        except RouterConfigError as exc:
            logger.error("upstreams file not reloaded, keeping %d upstreams: %s", len(self.replicas), exc)
            self.metrics.config_reloaded(False)
            return False
        added, removed = self.replicas.replace((*self.config.upstreams, *from_file))
        for url in removed:
            self.metrics.forget_upstream(url)
        for url in added:
            replica = self.replicas.get(url)
            if replica is not None:
                self._spawn(self.probe_one(replica))
        self.metrics.config_reloaded(True)
        logger.info("upstreams file %s loaded: %d upstreams", self.upstreams_file.path, len(self.replicas))
        return True

    def request_reload(self) -> None:
        """SIGHUP handler: reload the upstreams file (no-op without one)."""
        if self.upstreams_file is not None:
            self.reload_upstreams()
        else:
            logger.info("SIGHUP ignored: the router has no --config file")

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        # Keep a reference: the loop holds tasks only weakly.
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
