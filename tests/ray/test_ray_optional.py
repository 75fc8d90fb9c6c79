"""``ember serve`` without ``--ray`` never imports Ray: ``ember[ray]`` stays optional."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_ember_serve_and_its_options_do_not_import_ray() -> None:
    code = (
        "import sys\n"
        "from ember.cli import build_parser\n"
        "import ember.server.serve, ember.ray, ember.ray.cli, ember.ray.config, ember.ray.routing, ember.ray.autoscale\n"
        "args = build_parser().parse_args(['serve', '--replicas', '2'])\n"
        "assert not args.ray\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
