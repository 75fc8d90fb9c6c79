"""Start real ``ember`` processes (serve, route) on free ports: for benchmarks and tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx

LOG_DIR = Path(os.environ.get("EMBER_TEST_LOGS", "/tmp/ember-test-logs"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A subprocess running ``ember <command> ...`` on 127.0.0.1:<free port>; a context manager.

    ``grpc=True`` also serves gRPC on another free port (``grpc_port``);
    ``tls=(certfile, keyfile)`` serves https, and TLS on the gRPC port.
    """

    def __init__(
        self,
        *args: str,
        command: str = "serve",
        env: dict[str, str] | None = None,
        threads: int = 2,
        grpc: bool = False,
        tls: tuple[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.tls = tls
        self.base = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"
        self.grpc_port = free_port() if grpc else None
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{command}-{self.port}.log"
        argv = [sys.executable, "-m", "ember.cli", command, "--port", str(self.port), *args]
        if command == "serve":
            argv += ["--threads", str(threads)]
        if self.grpc_port is not None:
            argv += ["--grpc-port", str(self.grpc_port)]
        if tls is not None:
            argv += ["--ssl-certfile", tls[0], "--ssl-keyfile", tls[1]]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (open while the process runs; stop() closes it)
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def __enter__(self) -> ServerProcess:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 240.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base}/ready", timeout=2, verify=self.verify).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        log = self.log()
        self.stop()
        raise TimeoutError(f"server not ready after {timeout}s:\n{log}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def access_log(self, status: int | None = None) -> list[dict]:
        """The server's access-log entries (one JSON object per request), optionally of one status.

        ``total_s`` in each is the server's own time for the exchange, from the
        first middleware to the last byte sent.
        """
        self._log.flush()
        entries = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            start = line.find('{"request_id"')
            if start < 0:
                continue
            try:
                entry = json.loads(line[start:])
            except ValueError:
                continue
            if status is None or entry.get("status") == status:
                entries.append(entry)
        return entries

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """What an httpx client passes as ``verify``: trust the self-signed certificate under TLS."""
        return ssl.create_default_context(cafile=self.tls[0]) if self.tls else True

    @property
    def grpc_url(self) -> str:
        """The SDK's base URL of the gRPC port: grpc://127.0.0.1:<port> (grpcs:// under TLS)."""
        if self.grpc_port is None:
            raise ValueError("started without grpc=True")
        return f"{'grpcs' if self.tls else 'grpc'}://127.0.0.1:{self.grpc_port}"

    def metrics(self) -> str:
        return httpx.get(f"{self.base}/metrics", timeout=10, verify=self.verify).text

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def metric_value(text: str, name: str, labels: dict[str, str] | None = None, default: float | None = None) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (prometheus text format).

    No such sample raises ``KeyError``, or returns ``default`` when one is given
    (a labelled counter has no sample until it is first incremented).
    """
    from prometheus_client.parser import text_string_to_metric_families

    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
                found = True
    if not found:
        if default is not None:
            return default
        raise KeyError(name)
    return total
