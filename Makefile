# One entry point for humans and CI.
#   make run    set up a virtualenv and run the demo on a local dock
#   make test   set up (frameworks for the plugin tests and the Mooncake engine included) and run the tests
#               but the slow ones; `make test-slow` runs those (CI runs both)
#   make mooncake  the Mooncake Transfer Engine (.[mooncake]) and the system library it loads (libibverbs1)
#   make docs   build the documentation site (API reference from the docstrings) into site/
#   make dist   build the sdist and the wheel into dist/ (the request path compiled where a C compiler is present)
#   make test-compiled  the unit tests against the compiled modules
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dockd-installed
# torch is pinned to the CPU build that installs from a local wheel; a looser
# spec would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: setup run test test-slow test-fast test-compiled frameworks mooncake proto bench bench-peers check docs dist clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]' $(TORCH)
	touch $@

setup: $(STAMP)

run: setup
	$(VENV)/bin/dockd demo

frameworks: setup
	@if [ -f scripts/install_frameworks.sh ]; then bash scripts/install_frameworks.sh $(PY); fi
	@# the real libnccl.so.2 the device-binding tests load (the CPU torch build has none)
	@if [ "$$(uname -sm)" = "Linux x86_64" ] && ! $(PY) -c "import nvidia.nccl" 2>/dev/null; then \
		$(PY) -m pip install -q 'nvidia-nccl-cu13>=2.20'; fi

# The Mooncake Transfer Engine (tests/integration/test_mooncake.py is skipped without it): the RDMA
# user-space libraries its wheel links (libibverbs1, from apt where it is missing and we are root),
# then the wheel (.[mooncake]). Linux x86_64 only.
mooncake: setup
	@if [ "$$(uname -sm)" = "Linux x86_64" ]; then \
		if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then \
			if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
				out=$$( (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 ibverbs-providers) 2>&1) \
					|| echo "$$out" "make mooncake: could not install libibverbs1; the Mooncake tests will be skipped"; \
			else echo "make mooncake: libibverbs1 is missing (as root: apt-get install libibverbs1 ibverbs-providers)"; fi; \
		fi; \
		$(PY) -c "import mooncake.engine" 2>/dev/null || $(PY) -m pip install -q --no-warn-conflicts -e '.[mooncake]' $(TORCH); \
	fi

test: frameworks mooncake
	$(PY) -m pytest -m "not slow"

# the slow tests (Ray clusters, the wheel in a fresh venv, GRPO training, the chaos test, ...): CI runs them too
test-slow: frameworks mooncake
	$(PY) -m pytest -m slow

test-fast: setup
	$(PY) -m pytest -m "not slow"

proto: setup
	$(PY) proto/gen.py

check: setup
	$(VENV)/bin/ruff check dockd tests benchmarks examples scripts
	$(VENV)/bin/mypy

docs: setup
	$(VENV)/bin/mkdocs build --strict --site-dir site

# the sdist and the wheel (dist/dockd-VERSION.tar.gz, dist/dockd-VERSION-cpXY-...whl). The wheel
# declares torch as a range (pyproject.toml); install torch first the way your machine needs it.
# Built with the virtualenv's mypy (no isolation), the wheel holds the request path compiled with mypyc
# where a C compiler is present (setup.py's COMPILED; each .py stays as its fallback); DOCKD_PURE=1, or no
# compiler, gives the pure-Python wheel (dockd-VERSION-py3-none-any.whl).
dist: setup
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .

# the unit tests against the compiled modules, in a compiled copy of the checkout (CI runs it)
test-compiled: setup
	scripts/test_compiled.sh $(PY)

bench: setup
	$(PY) -m benchmarks

# The peers (TransferQueue, Ray, tensordict: .[peers]) go in a virtualenv of their own: their ray and
# tensordict would replace the versions the frameworks in $(VENV) were installed with.
PEERS_VENV ?= .venv-peers
bench-peers:
	@[ -x $(PEERS_VENV)/bin/python ] || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q $(TORCH)
	$(PEERS_VENV)/bin/python -m pip install -q -e '.[dev,peers]' $(TORCH)
	$(PEERS_VENV)/bin/python -m benchmarks

clean:
	rm -rf $(VENV) $(PEERS_VENV) .pytest_cache .hypothesis
