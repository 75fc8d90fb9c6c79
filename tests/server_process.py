"""Run real `ember serve` (or `ember route`) processes on free ports for tests."""

from __future__ import annotations

import os
import signal
import socket
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
    """A subprocess running ``ember <command> ...`` on 127.0.0.1:<free port>."""

    def __init__(self, *args: str, command: str = "serve", env: dict[str, str] | None = None, threads: int = 2) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{command}-{self.port}.log"
        argv = [sys.executable, "-m", "ember.cli", command, "--port", str(self.port), *args]
        if command == "serve":
            argv += ["--threads", str(threads)]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def metrics(self) -> str:
        return httpx.get(f"{self.base}/metrics", timeout=10).text

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


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (prometheus text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
                found = True
    if not found:
        raise KeyError(name)
    return total
