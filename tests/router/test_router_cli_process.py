"""``ember route`` as a real process: serves, reloads its upstreams file on SIGHUP, stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from router_fakes import wait_until

# ``ember.cli`` also imports the server and bench commands; the router's own
# ``register`` is what this test is about, so it builds the parser itself.
LAUNCH = """
import argparse, sys
from ember.router import cli
parser = argparse.ArgumentParser()
cli.register(parser.add_subparsers())
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(60)
def test_route_command_serves_and_reloads_on_sighup(upstreams, tmp_path) -> None:
    a, b = upstreams[0], upstreams[1]
    config = tmp_path / "upstreams.json"
    config.write_text(json.dumps([a.url]))
    port = free_port()
    flags = f"--port {port} --probe-interval 600 --log-level warning".split()
    command = [sys.executable, "-c", LAUNCH, "route", "--config", str(config), *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=5) as client:

            def ready() -> bool:
                try:
                    return client.get("/ready").status_code == 200
                except httpx.TransportError:
                    assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
                    return False

            wait_until(ready, timeout_s=30, interval_s=0.1)
            reply = client.post("/v1/chat/completions", json={"model": "m", "messages": []})
            assert reply.json()["choices"][0]["message"]["content"] == "Hello from a!"

            def listed() -> list[str]:
                return [u["url"] for u in client.get("/admin/upstreams").json()["upstreams"]]

            config.write_text(json.dumps([b.url]))
            # Probes (and with them mtime polling) run every 600 s: only SIGHUP can do this.
            os.kill(process.pid, signal.SIGHUP)
            wait_until(lambda: listed() == [b.url], timeout_s=5)
            assert client.post("/v1/chat/completions", json={"model": "m", "messages": []}).headers["x-upstream"] == "b"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.timeout(30)
def test_route_command_refuses_an_invalid_upstreams_file(tmp_path) -> None:
    config = tmp_path / "upstreams.toml"
    config.write_text("upstreams = [")
    result = subprocess.run(
        [sys.executable, "-c", LAUNCH, "route", "--config", str(config)], capture_output=True, text=True, timeout=25
    )
    assert result.returncode == 2 and "not valid TOML" in result.stderr
