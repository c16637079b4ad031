# Everything a fresh machine needs is fetched here, by package name, into a cache outside the
# checkout, so a second run (or a fresh clone on the same machine) neither downloads nor compiles.
SHELL := /bin/bash
PYTHON ?= python3
CACHE ?= $(HOME)/.cache/llmgw
VENV := .venv
PY := $(VENV)/bin/python
LLAMA_CPP_PYTHON := 0.3.36
CONSUL_BIN := $(CACHE)/consul/usr/bin/consul
PROMTOOL_BIN := $(CACHE)/prometheus/usr/bin/promtool
# llama.cpp is built for x86-64-v3 (AVX2, FMA, F16C), not -march=native: CPUs that advertise AMX
# inside VMs that never enabled its register state die with SIGILL on the first quantized matmul
# (seen here: `tilezero` in libggml-cpu.so on Gemma's first completion). The flavour is part of the
# cache path, so a wheel built the old way is never picked up again.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
LLAMA_WHEELS := $(CACHE)/wheels/llama-cpp-python-$(LLAMA_CPP_PYTHON)-x86-64-v3
LLAMA_WHEEL_STAMP := $(LLAMA_WHEELS)/.built
# The real llama.cpp programs (`llama-server`, and `ggml-rpc-server` for the workers of a multi-node
# replica), built from the llama.cpp source the same llama-cpp-python sdist vendors, with the same
# flavour as the wheel, so both engines run the same llama.cpp.
LLAMA_CPP := $(CACHE)/llama.cpp-$(LLAMA_CPP_PYTHON)-x86-64-v3
LLAMA_CPP_STAMP := $(LLAMA_CPP)/.built
LLAMA_CPP_SOURCE := $(LLAMA_CPP)/src/.extracted
LLAMA_SERVER_BIN := $(LLAMA_CPP)/build/bin/llama-server
RPC_SERVER_BIN := $(LLAMA_CPP)/build/bin/ggml-rpc-server
# The Prometheus server the dev stack runs comes from bullseye: Debian's later packages are built
# without Consul service discovery (since 2.33.5+ds1-4), which is how it finds llmgw. Its web UI
# links its scripts, styles and fonts from the libjs-* packages, unpacked beside it.
PROMETHEUS_BIN := $(CACHE)/prometheus-server/usr/bin/prometheus
PROMETHEUS_PKGS := prometheus libjs-bootstrap4 libjs-eonasdan-bootstrap-datetimepicker libjs-jquery \
	libjs-jquery-hotkeys libjs-moment libjs-moment-timezone libjs-mustache libjs-popper.js \
	libjs-rickshaw libjs-d3 fonts-glyphicons-halflings
CHROMIUM_BIN := $(CACHE)/chromium/chromium
export LLMGW_CONSUL_BIN := $(CONSUL_BIN)
export LLMGW_PROMTOOL_BIN := $(PROMTOOL_BIN)
export LLMGW_PROMETHEUS_BIN := $(PROMETHEUS_BIN)
export LLMGW_CHROMIUM_BIN := $(CHROMIUM_BIN)
export LLMGW_LLAMA_SERVER_BIN := $(LLAMA_SERVER_BIN)
export LLMGW_RPC_SERVER_BIN := $(RPC_SERVER_BIN)

.PHONY: setup test test-fast lint typecheck pytest demo clean wrk wrk-check

setup: $(VENV)/.installed $(CONSUL_BIN) $(PROMTOOL_BIN) $(PROMETHEUS_BIN) $(CHROMIUM_BIN) $(LLAMA_CPP_STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# llama.cpp compiles for about four minutes; the wheel is kept so it happens once per machine.
$(LLAMA_WHEEL_STAMP):
	@mkdir -p $(LLAMA_WHEELS)
	@echo "building llama-cpp-python $(LLAMA_CPP_PYTHON) once (compiles llama.cpp, ~4 min on 2 cores)..."
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PYTHON) -m pip wheel --no-deps --no-cache-dir --wheel-dir $(LLAMA_WHEELS) 'llama-cpp-python==$(LLAMA_CPP_PYTHON)'
	@touch $@

# Only the two programs are built (not the examples or tests); about 10-15 minutes on 2 busy cores,
# once per machine. The sdist is kept too, so a rebuild after a failed compile does not download.
$(LLAMA_CPP_SOURCE):
	@mkdir -p $(LLAMA_CPP)/sdist $(LLAMA_CPP)/src
	test -n "$$(ls $(LLAMA_CPP)/sdist/llama_cpp_python-*.tar.gz 2>/dev/null)" || \
		$(PYTHON) -m pip download --quiet --no-deps --no-binary llama-cpp-python --dest $(LLAMA_CPP)/sdist \
		'llama-cpp-python==$(LLAMA_CPP_PYTHON)'
	tar -xzf $(LLAMA_CPP)/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_CPP)/src --strip-components=1
	@touch $@

$(LLAMA_CPP_STAMP): | $(LLAMA_CPP_SOURCE)
	@echo "building llama-server and ggml-rpc-server once (~10-15 min on 2 cores)..."
	cmake -S $(LLAMA_CPP)/src/vendor/llama.cpp -B $(LLAMA_CPP)/build $(LLAMA_CMAKE_ARGS) \
		-DGGML_RPC=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DCMAKE_BUILD_TYPE=Release
	cmake --build $(LLAMA_CPP)/build -j2 --target llama-server ggml-rpc-server
	@test -x $(LLAMA_SERVER_BIN) && test -x $(RPC_SERVER_BIN)
	@touch $@

# The engines for real GPU nodes (docs/operating.md, "CUDA engines"): the same llama.cpp source
# and flags as the build above, plus CUDA, installed as a node expects them under
# $(CUDA_ENGINES)/llama.cpp/$(LLAMA_CPP_VERSION)/ with their libraries beside them ($$ORIGIN), and
# sealed with a SHA256SUMS the node agent verifies them by where it cannot run them (its
# container has no CUDA runtime). Needs the CUDA toolkit (nvcc) and cmake on the building
# machine, not a GPU; 216 s on 16 cores for one architecture.
CUDA_ARCHITECTURES ?= 80;86;89;90
CUDA_ENGINES ?= $(CACHE)/engines-cuda
LLAMA_CPP_VERSION ?= b6500
LLAMA_CUDA_BUILD := $(CACHE)/llama.cpp-$(LLAMA_CPP_PYTHON)-cuda
.PHONY: cuda-engines
cuda-engines: $(LLAMA_CPP_SOURCE)
	cmake -S $(LLAMA_CPP)/src/vendor/llama.cpp -B $(LLAMA_CUDA_BUILD) $(LLAMA_CMAKE_ARGS) \
		-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$(CUDA_ARCHITECTURES)" -DGGML_CUDA_NCCL=OFF \
		-DGGML_RPC=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_NUMBER=$(patsubst b%,%,$(LLAMA_CPP_VERSION)) \
		-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$$ORIGIN' -DCMAKE_BUILD_TYPE=Release
	cmake --build $(LLAMA_CUDA_BUILD) -j$$(nproc) --target llama-server ggml-rpc-server
	rm -rf $(CUDA_ENGINES)/llama.cpp/$(LLAMA_CPP_VERSION) && mkdir -p $(CUDA_ENGINES)/llama.cpp/$(LLAMA_CPP_VERSION)
	cp -a $(LLAMA_CUDA_BUILD)/bin/llama-server $(LLAMA_CUDA_BUILD)/bin/ggml-rpc-server \
		$(LLAMA_CUDA_BUILD)/bin/*.so* $(CUDA_ENGINES)/llama.cpp/$(LLAMA_CPP_VERSION)/
	cd $(CUDA_ENGINES)/llama.cpp/$(LLAMA_CPP_VERSION) && sha256sum llama-server ggml-rpc-server *.so* > SHA256SUMS
	@echo "llama.cpp $(LLAMA_CPP_VERSION) with CUDA: copy $(CUDA_ENGINES)/llama.cpp/$(LLAMA_CPP_VERSION) to each GPU node's llmgw_engines_dir"

$(VENV)/.installed: pyproject.toml $(VENV)/bin/python $(LLAMA_WHEEL_STAMP)
	$(PY) -m pip install --quiet --no-deps --force-reinstall $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_CPP_PYTHON)-*.whl
	$(PY) -m pip install --quiet --find-links $(LLAMA_WHEELS) \
		'llama-cpp-python[server]==$(LLAMA_CPP_PYTHON)' -e '.[dev]'
	@touch $@

$(CONSUL_BIN):
	bash devstack/fetch-deb.sh consul bullseye $(CACHE)/consul
	@test -x $@

$(PROMTOOL_BIN):
	bash devstack/fetch-deb.sh prometheus bookworm $(CACHE)/prometheus
	@test -x $@

$(PROMETHEUS_BIN):
	bash devstack/fetch-deb.sh "$(PROMETHEUS_PKGS)" bullseye $(CACHE)/prometheus-server
	@test -x $@

# wrk, the C load generator bench/router_bench.py compares the router under (with the LuaJIT
# library it links, which dpkg -x does not bring along).
WRK_BIN := $(CACHE)/wrk/usr/bin/wrk
wrk: $(WRK_BIN)
$(WRK_BIN):
	bash devstack/fetch-deb.sh "wrk libluajit-5.1-2" bookworm $(CACHE)/wrk
	@test -x $@

# The router against a bare aiohttp proxy under wrk, alone (router_bench.py runs it at its end too).
# It needs what `make setup` made, and does not depend on it: in a git worktree that shares a
# checkout's virtualenv, setup would re-point the venv's editable install at the worktree.
wrk-check: wrk
	$(PY) bench/router_bench.py --wrk-only

# Debian's chromium for the browser tests (Playwright drives it; it never downloads a browser),
# with whichever of its libraries this machine lacks, unpacked privately like the rest.
$(CHROMIUM_BIN):
	bash devstack/fetch-chromium.sh $(CACHE)/chromium
	@test -x $@

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

# The 25 slowest tests and fixture set-ups are printed on every run, so the suite's cost stays
# in view (CI prints them too). Most tests wait (on Consul, the stand-in, an engine starting),
# so they run on PYTEST_WORKERS processes even on two cores: each worker has its own Consul agent
# and its own bands of ports (devstack/ports.py), and a module's tests stay on one worker
# (--dist loadscope), so module fixtures are made once. PYTEST_WORKERS=0 runs them in one process.
PYTEST_WORKERS ?= 2
pytest: setup
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadscope --durations=25 $(PYTEST_ARGS)

# While editing: the tests that start no process of their own (no Consul, stand-in, engine,
# router or watcher subprocess), marked so by tests/conftest.py. Under two minutes; `make test`
# still runs everything.
test-fast: $(VENV)/.installed
	$(VENV)/bin/pytest -q -m "not external" $(PYTEST_ARGS)

test: lint typecheck pytest

demo: setup
	$(PY) -m devstack up

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
