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

.PHONY: remote-deps engine-deps engine-deps-sglang engine-deps-vllm venv run test test-slow test-reliability test-engines proto bench demo clean distclean

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
	$(MAKE) --no-print-directory engine-deps
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

# The engines tierstore serves (docs/engines.md), for their CPU tests: each wheel --no-deps,
# then only what its Engram modules import, under a constraint that holds the installed torch
# (their own pins want a CUDA torch and PyPI's torchvision, which links one). Failure is
# tolerated: the engine tests then skip and say why.
ENGINE_WHEELS ?= /tmp/engwheels
ENGINE_LINKS := $(if $(wildcard $(ENGINE_WHEELS)),--find-links $(ENGINE_WHEELS),)
TORCH_PIN := $(VENV)/torch-pin.txt
# What `import sglang.srt.layers.engram` (and engram_staging) reaches, at sglang's own pins
# where it pins; torchvision is not among them (tierstore.client.engines.sglang imports
# the modules without it: docs/engines.md).
SGLANG_ENGRAM_DEPS := msgspec orjson psutil pybase64 starlette pydantic pyzmq "apache-tvm-ffi==0.1.11" \
  "transformers==5.19.0" ipython dill "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf "openai==2.8.0" \
  partial_json_parser

# What `import vllm.models.deepseek_v41.common.engram` reaches (its own import chain runs
# through vllm.model_executor.layers.linear into vllm.v1 and vllm.multimodal), and the V2
# runner's modules the engine tests build (vllm.v1.worker.gpu), at pins every supported vLLM
# accepts; no torchvision, torchaudio, flashinfer or CUDA wheel among them.
VLLM_ENGRAM_DEPS := regex "pydantic>=2.12.0" cbor2 psutil "pyzmq>=25.0.0" "transformers>=5.16.1,<5.21.0" \
  openai-harmony "openai>=2.25.0" pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo \
  "xgrammar==0.2.8" "fastapi>=0.133.0,<0.137.0" partial-json-parser "llguidance>=1.7.0,<1.8.0" einops \
  "huggingface_hub>=2.0.0" "orjson>=3.11.6"
# The supported releases (client/engines/checks.py SUPPORTED, oldest first) and the newest of them.
VLLM_VERSIONS = $(shell $(PY) -c "from tierstore.client.engines.checks import SUPPORTED; print(*SUPPORTED['vllm'][1])")
SGLANG_VERSION = $(shell $(PY) -c "from tierstore.client.engines.checks import SUPPORTED; print(SUPPORTED['sglang'][1][-1])")

engine-deps: engine-deps-sglang engine-deps-vllm

$(TORCH_PIN):
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $@

engine-deps-sglang: $(TORCH_PIN)
	-( $(PIP) install -q --no-deps -c $(TORCH_PIN) $(ENGINE_LINKS) "sglang==$(SGLANG_VERSION)" && \
	   $(PIP) install -q -c $(TORCH_PIN) $(FIND_LINKS) $(SGLANG_ENGRAM_DEPS) ) \
	  || echo "sglang $(SGLANG_VERSION) unavailable: tests/client/engines/test_sglang*.py will skip"

# The newest supported vLLM (the default suite's); `make test-engines` runs the engine tests
# against the others too.
engine-deps-vllm: $(TORCH_PIN)
	-( v=$(lastword $(VLLM_VERSIONS)); $(PIP) install -q --no-deps -c $(TORCH_PIN) $(ENGINE_LINKS) "vllm==$$v" && \
	   $(PIP) install -q -c $(TORCH_PIN) $(FIND_LINKS) $(VLLM_ENGRAM_DEPS) && \
	   $(PY) -c "import vllm.models.deepseek_v41.common.engram" 2>/dev/null ) \
	  || echo "vllm $(lastword $(VLLM_VERSIONS)) unavailable: tests/client/engines/test_vllm*.py will skip"

proto: $(STAMP)
	$(PY) proto/generate.py

$(DATA)/catalog: | $(STAMP)
	$(VENV)/bin/tierstore demo-table --preset engram-paper-demo --scale 64 --data $(DATA)

run: $(STAMP) $(DATA)/catalog
	$(VENV)/bin/tierstore demo --data $(DATA)
	$(VENV)/bin/tierstore bench lookup --data $(DATA) --quick --out $(DATA)/bench

# The default suite in TEST_WORKERS processes (pytest-xdist), each test file whole in one of
# them, in its own order; the slow and reliability suites time and load the host, so run alone.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile

test-slow: $(STAMP)
	$(VENV)/bin/pytest -q -m slow

test-reliability: $(STAMP)
	$(VENV)/bin/pytest -q -m reliability

# The engine tests against every supported engine release (the default suite runs them against
# the newest vLLM only): each vLLM wheel --no-deps into a directory of its own under
# $(VENV)/engines, put first on the path (PYTHONPATH: its `vllm` and its dist-info's version
# shadow the venv's), the venv's other packages shared; then sglang's tests (one release).
# The directories are kept for the next run. Must be run with vLLM's CPU test set-up (make venv).
VLLM_TESTS := tests/client/engines/test_vllm_plugin.py tests/client/engines/test_vllm_stager.py \
  tests/client/engines/test_hash_agreement_vllm.py tests/client/engines/test_seams.py \
  tests/client/engines/test_checks.py tests/bench/test_gpu_check.py
SGLANG_TESTS := tests/client/engines/test_sglang.py tests/client/engines/test_sglang_hash.py \
  tests/client/engines/test_sglang_plugin.py tests/client/engines/test_sglang_stager.py \
  tests/client/engines/test_step_reads.py tests/client/engines/test_staging_buffers.py \
  tests/client/engines/test_weight_filter.py
test-engines: $(STAMP)
	@set -e; for v in $(VLLM_VERSIONS); do \
	  d=$(abspath $(VENV))/engines/vllm-$$v; \
	  if ! test -f $$d/.installed; then rm -rf $$d; \
	    $(PIP) install -q --no-deps $(ENGINE_LINKS) --target $$d "vllm==$$v" && touch $$d/.installed; fi; \
	  echo "== vLLM $$v"; \
	  PYTHONPATH=$$d $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile $(VLLM_TESTS); \
	done
	@echo "== sglang $(SGLANG_VERSION)"
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile $(SGLANG_TESTS)

# Redis is a baseline of the lookup scenario: a real server, installed here.
bench: $(STAMP) $(DATA)/catalog
	command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) || echo "redis-server unavailable: the Redis baseline will be skipped"
	$(VENV)/bin/tierstore bench all --data $(DATA) --out bench-results

clean:
	rm -rf $(DATA) bench-results build *.egg-info .pytest_cache .hypothesis

distclean: clean
	rm -rf $(VENV)
