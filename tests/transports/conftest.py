"""Real servers for the transport tests, started once per test package (each costs a model load).

- ``grpc_server``: uvicorn (HTTP/1.1) plus ``--grpc-port``, an API key, and room for one
  request only (``--max-running 1 --max-queue 0``), so overload is one held stream away.
- ``h2_server``: ``--http2`` on cleartext (HTTP/1.1 and h2c), 64 requests may run at once.
- ``tls_server``: ``--http2`` and ``--grpc-port`` over TLS with a self-signed certificate.

``grpc_server`` and ``h2_server`` run without prefix caching and sessions (``NO_CACHE``):
the same-text test compares transports, and with caches a turn's KV may come from
whichever conversation ran first, computed in other shapes, which can flip a
near-tie of greedy decoding whatever the transport. Without them every request is
computed the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.tls_cert import self_signed_cert
from server_process import ServerProcess
from transport_common import API_KEY


@pytest.fixture(scope="package")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    cert, key = self_signed_cert(Path(tmp_path_factory.mktemp("tls")))
    return str(cert), str(key)


NO_CACHE = ("--no-prefix-caching", "--no-sessions")


@pytest.fixture(scope="package")
def grpc_server() -> Iterator[ServerProcess]:
    args = ("--api-key", API_KEY, "--max-running", "1", "--max-queue", "0", "--warmup-requests", "1", *NO_CACHE)
    with ServerProcess(*args, grpc=True) as proc:
        yield proc


@pytest.fixture(scope="package")
def h2_server() -> Iterator[ServerProcess]:
    with ServerProcess("--http2", "--max-running", "64", "--warmup-requests", "1", *NO_CACHE) as proc:
        yield proc


@pytest.fixture(scope="package")
def tls_server(certs: tuple[str, str]) -> Iterator[ServerProcess]:
    with ServerProcess("--http2", "--warmup-requests", "1", grpc=True, tls=certs) as proc:
        yield proc
