# raychat: the two front-door commands are `make speedrun` and `make test`.
# Each creates (or refreshes) .venv inside the repo, installs torch and the project, then runs.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# CPU default. On a CUDA machine: make speedrun TORCH_SPEC=torch==2.13.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PRESET ?= cpu
EXTRAS ?= test
# the lock of the install; the vLLM environment: EXTRAS=vllm CONSTRAINTS=constraints-vllm.txt (docs/deployment.md)
CONSTRAINTS ?= constraints.txt
PIP := $(VENV)/bin/pip
RUN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(EXTRAS)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv speedrun test test-fast lint format corpus-deps test-deps s3-server lock clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24"
	$(PIP) install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	touch $@

venv: $(STAMP)

# The S3-compatible server the tests use (moto), in a venv of its own: moto needs python-dateutil<3,
# kubernetes>=3. tests/support/s3_server.py starts .venv/s3/bin/moto_server on a free loopback port.
S3_VENV := $(VENV)/s3
S3_STAMP := $(S3_VENV)/.installed
$(S3_STAMP): constraints-s3.txt
	test -x $(S3_VENV)/bin/python || $(PYTHON) -m venv $(S3_VENV)
	$(S3_VENV)/bin/pip install -q -c constraints-s3.txt "moto[s3]" flask flask-cors
	touch $@

s3-server: $(S3_STAMP)

# Debian packages that hold the default corpus and task data (real text, see README "Data").
CORPUS_DEBS := python3.11-doc wordnet-base wamerican
# ... and what the tests drive: headless Chromium for the chat page test, Prometheus for the dashboard's
# queries (tests/cluster/test_prometheus.py).
TEST_DEBS := $(CORPUS_DEBS) chromium chromium-driver prometheus

corpus-deps:
	@dpkg -s $(CORPUS_DEBS) >/dev/null 2>&1 || \
	  ( $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $(CORPUS_DEBS) )

# The official openai Node client for the contract test (tests/node, pinned by its package-lock.json).
NODE_DEPS := tests/node/node_modules/.package-lock.json

$(NODE_DEPS): tests/node/package.json tests/node/package-lock.json
	npm ci --prefix tests/node --no-audit --no-fund
	touch $@

test-deps: $(NODE_DEPS)
	@dpkg -s $(TEST_DEBS) >/dev/null 2>&1 || \
	  ( $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $(TEST_DEBS) )

speedrun: $(STAMP) corpus-deps
	$(RUN)/raychat speedrun --preset $(PRESET)

lint: $(STAMP)
	$(RUN)/ruff check .
	$(RUN)/ruff format --check .

format: $(STAMP)
	$(RUN)/ruff format .
	$(RUN)/ruff check --fix .

# Full suite: lint, then every test on 2 pytest-xdist workers, scheduled by tests/support/tier_scheduling.py
# (tests/cluster on one worker, the tests/ray modules and the rest spread over both). Measured 2026-12-04 on one
# 2-core machine: the whole suite in 1139 s (.ci/run on a clean clone: 1246 s with the install), where the Ray
# tiers alone took 1771 s run one at a time.
# The bytecode of raychat is compiled first: where PYTHONDONTWRITEBYTECODE=1 (these machines set it) no process
# writes it, and each process of the suite that imports raychat (Ray Train workers, RL actors, Serve replicas, Ray
# Data tasks, CLI runs: about 340, counted from bench/results/suite_cpu.md's kinds) compiled its ~110 modules
# again: 0.15 CPU-s a process (measured 2026-12-07, `import raychat.train.worker, ...` with and without them).
test: lint test-deps s3-server
	$(RUN)/python -m compileall -q platform
	$(RUN)/pytest -q -n 2 --durations=15

# Fast tier only (a few minutes): no Ray cluster, no slow tests; 2 pytest-xdist workers (2026-12-03, idle machine:
# 178 s against 184 s serial; the tier is CPU-bound on the 2 cores). Every fast test is in tests/unit
# (tests/conftest.py marks all of tests/ray and tests/cluster `ray`): collecting that folder alone skips
# importing the Ray tiers' modules (23 s against 30 s of collection per worker).
test-fast: lint s3-server
	$(RUN)/pytest -q -n 2 -m "not ray and not slow" tests/unit

# Regenerate constraints.txt from the current venv (after a tested upgrade).
lock: $(STAMP)
	$(PIP) freeze --exclude-editable | grep -v '^torch==' > constraints.txt

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache tests/node/node_modules
