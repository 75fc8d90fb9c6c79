"""`ember serve` lives on the runtime dependencies: serving imports nothing from the extras.

The runtime set is ``[project] dependencies`` in pyproject.toml (what
``pip install ember`` and ``make serve`` install). A real ``ember serve`` runs
with ``PYTHONPROFILEIMPORTTIME=1`` (``python -X importtime``): its log then
names every module the process imported, at start-up and while it answers a
streamed chat completion and ``/metrics``, and stops. The extras are all
installed where the tests run, so an import of one of them would succeed and
be logged: none may be. gRPC is imported only when ``--grpc-port`` asks for it.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import httpx
import pytest

from server_process import ServerProcess

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# Top-level modules of packages that only an extra installs (test, plots, grpc, h2, http2, ray).
EXTRA_MODULES = {
    "matplotlib", "transformers", "accelerate", "schemathesis", "pytest", "openai", "playwright",
    "grpc", "grpc_tools", "grpc_health", "grpc_reflection", "h2", "hypercorn", "granian", "ray",
}
# Their distributions, as pyproject names them.
EXTRA_DISTRIBUTIONS = {
    "matplotlib", "transformers", "accelerate", "schemathesis", "pytest", "openai", "playwright",
    "grpcio", "grpcio-tools", "grpcio-health-checking", "grpcio-reflection", "protobuf", "h2", "hypercorn", "granian", "ray",
}
# The grpc extra: what --grpc-port may import (grpc_tools when the generated code is missing or stale).
GRPC_EXTRA_MODULES = {"grpc", "grpc_tools", "grpc_health", "grpc_reflection"}


def runtime_distributions() -> set[str]:
    """The distribution names of ``[project] dependencies``."""
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return {re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0].lower() for spec in dependencies}


def test_the_runtime_dependency_set_leaves_the_extras_out() -> None:
    runtime = runtime_distributions()
    assert {"torch", "fastapi", "uvicorn", "tokenizers", "gguf"} <= runtime  # the parse reads the real list
    assert not runtime & EXTRA_DISTRIBUTIONS


def imported_modules(log: str) -> set[str]:
    """Every module an ``-X importtime`` log names (``import time: self | cumulative | name``, nested names indented)."""
    names = set()
    for line in log.splitlines():
        start = line.find("import time:")
        if start >= 0 and line.count("|") == 2:
            name = line[start:].rsplit("|", 1)[1].strip()
            if name != "imported package":  # the header line
                names.add(name)
    return names


def serve_and_list_imports(*args: str, grpc: bool = False) -> set[str]:
    """Start ``ember serve``, stream one reply, read /metrics, stop; the modules the process imported."""
    with ServerProcess(*args, "--warmup-requests", "1", grpc=grpc, env={"PYTHONPROFILEIMPORTTIME": "1"}) as server:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=60) as reply:
            assert reply.status_code == 200
            assert "data: [DONE]" in reply.read().decode()
        assert httpx.get(f"{server.base}/metrics", timeout=10).status_code == 200
        server.stop()
        return imported_modules(server.log_path.read_text(errors="replace"))


def top_level(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


@pytest.mark.timeout(300)
def test_ember_serve_imports_nothing_from_the_extras() -> None:
    modules = serve_and_list_imports()
    # The log is read: the server's own modules and torch are in it.
    assert {"ember.server.app", "ember.engine.engine", "torch", "uvicorn"} <= modules
    assert not top_level(modules) & EXTRA_MODULES, sorted(top_level(modules) & EXTRA_MODULES)
    assert "google.protobuf" not in modules


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpc_is_imported_when_grpc_port_asks_for_it() -> None:
    modules = serve_and_list_imports(grpc=True)
    assert {"grpc", "grpc_health", "grpc_reflection", "ember.grpc.server"} <= top_level(modules) | modules
    assert not top_level(modules) & (EXTRA_MODULES - GRPC_EXTRA_MODULES), sorted(top_level(modules) & EXTRA_MODULES)
