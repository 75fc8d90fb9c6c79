"""`ember chat` with piped stdin against a real server."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.timeout(180)
def test_piped_conversation_streams_and_reports_stats(server):
    lines = "My name is Ada.\n/reset\nWhat is 2 plus 2?\n/exit\nnever sent\n"
    result = subprocess.run(
        [sys.executable, "-m", "ember.cli", "chat", "--url", server.url, "--max-tokens", "12", "--temperature", "0"],
        input=lines, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("[TTFT") == 2  # two turns answered, the line after /exit never sent
    assert "new conversation" in out
    assert "tok/s" in out and "ms" in out
