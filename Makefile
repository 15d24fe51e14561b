# The few verbs people type. `make run` and `make test` do everything on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup os-deps cli-harnesses test test-fast lint fmt bench run clean

setup: os-deps $(STAMP) cli-harnesses

# Reinstall only when the dependency list or the compiled reader changes (it is built by the install); editable
# install means Python code changes need nothing.
$(STAMP): pyproject.toml setup.py clawpipe/lake/_openai_scan.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

os-deps:
	@bash scripts/os_deps.sh

# Real CLI agents (Claude Code, Codex CLI, Qwen Code, OpenClaw; pins in harnesses/*/cli.toml) from npm into .node/, each on the Node it needs; quick when already there.
cli-harnesses:
	@bash scripts/install_cli_harnesses.sh

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow and not docker"

lint: setup
	$(VENV)/bin/ruff format --check clawpipe flows tests bench harnesses
	$(VENV)/bin/ruff check clawpipe flows tests bench harnesses
	$(VENV)/bin/mypy clawpipe flows
	$(VENV)/bin/lint-imports

fmt: setup
	$(VENV)/bin/ruff format clawpipe flows tests bench harnesses
	$(VENV)/bin/ruff check --fix clawpipe flows tests bench harnesses

# Every bench/*.py but the shared pieces they import (data generators, the mock upstream); each ends with a JSON line.
BENCH_HELPERS := bench/data.py bench/tree_data.py bench/upstream.py
bench: setup
	@for b in $(filter-out $(BENCH_HELPERS),$(wildcard bench/*.py)); do echo "== $$b"; $(PY) $$b || exit 1; done

run: setup
	$(VENV)/bin/clawpipe run

clean:
	rm -rf .clawpipe .tmp .pytest_cache
