# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test install proto lint clean up

$(BIN)/python:
	$(PY) -m venv $(VENV) || (apt-get update -qq && apt-get install -y -qq python3-venv && $(PY) -m venv $(VENV))

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/kvdepot demo

up: install
	$(BIN)/kvdepot up

test: install
	$(BIN)/python -m pytest -q -ra

proto: install
	$(BIN)/python -m kvdepot.proto.generate

lint: install
	$(BIN)/ruff check .
	$(BIN)/python tests/typecheck.py

clean:
	rm -rf $(VENV) build .typecheck *.egg-info .pytest_cache .mypy_cache .ruff_cache
