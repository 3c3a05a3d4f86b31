# Two commands for a newcomer: `make quickstart` and `make test`.
VENV ?= $(if $(SPECSTOP_VENV),$(SPECSTOP_VENV),.venv)
PY := $(VENV)/bin/python
PAIR ?= qwen2.5-coder-0.5b-1.5b
QUICKSTART_CONFIG ?= configs/pipelines/quickstart.yaml

.PHONY: setup quickstart test test-all lint info check-core-install

setup:
	SPECSTOP_VENV=$(VENV) bash scripts/setup_env.sh

## Sets up, fetches + converts the reference pair, runs the quickstart pipeline.
quickstart: setup
	$(VENV)/bin/specstop fetch-pair $(PAIR)
	$(VENV)/bin/specstop info --pair $(PAIR)
	$(VENV)/bin/specstop pipeline --config $(QUICKSTART_CONFIG)

## Sets up and runs the test suite (CPU, tiny random models; `slow` tests skip without the real pair).
test: setup
	$(PY) -m pytest -q -m "not gpu" tests

## `pip install .` without extras in a fresh venv loads an export (built by the project venv, then
## moved) and decodes with our decoder, the public API and HF custom_generate, with no Lightning.
check-core-install: setup
	SPECSTOP_VENV=$(VENV) bash scripts/check_core_install.sh

lint: setup
	$(VENV)/bin/ruff check specstop tests benchmarks
