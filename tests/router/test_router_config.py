"""Router configuration, the upstreams file, and the ``route`` command line."""

from __future__ import annotations

import argparse
import os

import pytest

from ember.router import cli
from ember.router.config import (
    RouterConfig,
    RouterConfigError,
    UpstreamsFile,
    normalize_upstream_url,
    parse_upstreams_file,
)


@pytest.mark.timeout(5)
def test_upstream_urls_are_normalized() -> None:
    assert normalize_upstream_url("http://Host:8000/v1/") == "http://host:8000"
    assert normalize_upstream_url(" https://api.example.com/openai/v1 ") == "https://api.example.com/openai"
    for bad in ("localhost:8000", "ftp://h", "http://", "http://h?x=1"):
        with pytest.raises(RouterConfigError):
            normalize_upstream_url(bad)
    config = RouterConfig(upstreams=("http://a:1/v1", "http://a:1", "http://b:2"))
    assert config.upstreams == ("http://a:1", "http://b:2")


@pytest.mark.timeout(5)
@pytest.mark.parametrize(
    "overrides",
    [
        {"policy": "random"},
        {"load_epsilon": -0.1},
        {"breaker_failures": 0},
        {"max_attempts": 0},
        {"stall_timeout_s": 0},
    ],
)
def test_invalid_options_are_rejected(overrides: dict[str, object]) -> None:
    with pytest.raises(RouterConfigError):
        RouterConfig(**overrides)  # type: ignore[arg-type]


@pytest.mark.timeout(5)
def test_upstreams_file_shapes() -> None:
    expected = ("http://a:1", "http://b:2")
    assert parse_upstreams_file('["http://a:1", "http://b:2/v1"]', toml=False) == expected
    assert parse_upstreams_file('{"upstreams": [{"url": "http://a:1"}, "http://b:2"]}', toml=False) == expected
    assert parse_upstreams_file('upstreams = ["http://a:1", "http://b:2"]', toml=True) == expected
    tables = '[[upstreams]]\nurl = "http://a:1"\n[[upstreams]]\nurl = "http://b:2"\n'
    assert parse_upstreams_file(tables, toml=True) == expected
    for text, toml in (('{"upstreams": 3}', False), ("[1]", False), ("upstreams = [", True), ("{", False)):
        with pytest.raises(RouterConfigError):
            parse_upstreams_file(text, toml=toml)


@pytest.mark.timeout(5)
def test_upstreams_file_notices_changes(tmp_path) -> None:
    path = tmp_path / "upstreams.toml"
    path.write_text('upstreams = ["http://a:1"]')
    watched = UpstreamsFile(str(path))
    assert watched.changed()
    assert watched.load() == ("http://a:1",)
    assert not watched.changed()
    path.write_text('upstreams = ["http://a:1", "http://b:2"]')
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse file systems
    assert watched.changed()
    assert watched.load() == ("http://a:1", "http://b:2")
    path.unlink()
    assert watched.changed()
    with pytest.raises(RouterConfigError):
        watched.load()


@pytest.mark.timeout(5)
def test_route_subcommand_maps_flags_onto_config() -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    flags = "--upstream http://a:1 --upstream http://b:2/v1 --port 9000 --policy least-load --load-epsilon 0.5"
    flags += " --probe-interval 0.5 --breaker-failures 3 --breaker-open-seconds 4 --request-timeout 20 --admin-key k"
    flags += " --hide-upstream"
    args = parser.parse_args(["route", *flags.split()])
    assert args.func is cli.run_router
    config = cli.config_from_args(args)
    assert config.upstreams == ("http://a:1", "http://b:2")
    assert (config.port, config.policy, config.load_epsilon, config.probe_interval_s) == (9000, "least-load", 0.5, 0.5)
    assert (config.breaker_failures, config.breaker_open_s, config.request_timeout_s) == (3, 4.0, 20.0)
    assert config.admin_key == "k" and config.expose_upstream is False
    defaults = cli.config_from_args(parser.parse_args(["route"]))
    assert defaults == RouterConfig()  # the CLI's defaults are RouterConfig's


@pytest.mark.timeout(5)
def test_run_router_rejects_a_bad_upstream(capsys) -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["route", "--upstream", "not-a-url"])
    assert args.func(args) == 2
    assert "not-a-url" in capsys.readouterr().err
