# tierstore — every target does its own set-up on a fresh machine.
#   make run    virtualenv + install + demo table + sidecar + forward pass + short bench
#   make test   virtualenv + install + the default test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DATA ?= .tierstore-demo
STAMP := $(VENV)/.tierstore-installed
# The CPU torch wheel lies on disk on these machines; use it when present.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
TORCH_VERSION ?= 2.13.0

.PHONY: remote-deps venv run test test-slow test-reliability proto bench demo clean distclean

venv: $(STAMP)

# A torch the user already has is kept (the venv then sees the system
# site-packages); otherwise pin the release, which pip takes as the CPU build
# on a machine without CUDA. Never an unpinned torch: that pulls a CUDA build.
$(STAMP): pyproject.toml
	@if ! test -x $(PY); then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else $(PYTHON) -m venv $(VENV); fi; \
	fi
	$(PIP) install -q --upgrade "pip>=23.2" $(FIND_LINKS)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "using existing torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	else \
	  $(PIP) install -q $(FIND_LINKS) "torch==$(TORCH_VERSION)"; \
	fi
	$(PIP) install -q $(FIND_LINKS) -e ".[dev,bench]"
	$(MAKE) --no-print-directory remote-deps
	touch $(STAMP)

# Mooncake Store for the remote tier (optional: without it the remote tests skip and say why).
remote-deps:
	-$(PIP) install -q $(FIND_LINKS) -e ".[remote]" || echo "mooncake unavailable: remote tests will skip"
	@if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1) \
	      || echo "libibverbs1 not installed: remote tests will skip"; \
	  else echo "libibverbs1 missing (needs root and apt): remote tests will skip"; fi; \
	fi

proto: $(STAMP)
	$(PY) proto/generate.py

$(DATA)/catalog: | $(STAMP)
	$(VENV)/bin/tierstore demo-table --preset engram-paper-demo --scale 64 --data $(DATA)

run: $(STAMP) $(DATA)/catalog
	$(VENV)/bin/tierstore demo --data $(DATA)
	$(VENV)/bin/tierstore bench lookup --data $(DATA) --quick --out $(DATA)/bench

test: $(STAMP)
	$(VENV)/bin/pytest -q

test-slow: $(STAMP)
	$(VENV)/bin/pytest -q -m slow

test-reliability: $(STAMP)
	$(VENV)/bin/pytest -q -m reliability

# Redis is a baseline of the lookup scenario: a real server, installed here.
bench: $(STAMP) $(DATA)/catalog
	command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) || echo "redis-server unavailable: the Redis baseline will be skipped"
	$(VENV)/bin/tierstore bench all --data $(DATA) --out bench-results

clean:
	rm -rf $(DATA) bench-results build *.egg-info .pytest_cache .hypothesis

distclean: clean
	rm -rf $(VENV)
