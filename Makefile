# kvblock: `make demo` runs the main job, `make test` the test suite.
# Both install what they need: Debian packages (when root), a virtualenv in
# .venv, torch pinned to the CPU build, and kvblock itself (editable).

VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.kvblock-installed
APT_PKGS := liburing-dev libxxhash-dev pkg-config cmake fio util-linux fdisk e2fsprogs
TORCH   := torch==2.13.0
PYTEST_ARGS ?=
# Test processes (pytest-xdist), a test file to each at a time: the suite
# took 13 min in one process on the 2-core VM. TEST_JOBS=1 runs it in one.
# A worker that dies ends the run (--max-worker-restart=0): a replaced worker
# left the run waiting for good after its tests (seen twice).
TEST_JOBS ?= 2

.PHONY: all demo test bench install sysdeps engines clean distclean

all: install

sysdeps:
	@missing=""; for p in $(APT_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	$(PYTHON) -c "import venv, ensurepip" 2>/dev/null || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else \
	    echo "kvblock needs these Debian/Ubuntu packages:$$missing"; \
	    echo "install them with: sudo apt-get install$$missing"; exit 1; \
	  fi; \
	fi

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall when the build inputs change (the native core is built by CMake
# through scikit-build-core during pip install).
$(STAMP): pyproject.toml CMakeLists.txt $(wildcard native/*.c native/*.h) requirements/engines.txt | sysdeps $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test,demo]'
	$(MAKE) --no-print-directory engines
	@touch $(STAMP)

# The serving engines kvblock plugs into, for the integration tests against
# their real classes: the engine wheels without their GPU stacks (--no-deps),
# then only the light packages their imported modules need, torch kept at the
# CPU build. pip's resolver warnings about the engines' full requirements are
# expected.
ENGINES := vllm==0.33.0 sglang==0.5.23 lmcache==0.5.6
engines: | $(PY)
	$(PIP) install -q --no-deps $(ENGINES)
	$(PIP) install -q $(TORCH) -r requirements/engines.txt
	$(PIP) install -q --no-deps dill apache-tvm-ffi sentencepiece compressed-tensors loguru gguf
	$(PY) -c "import vllm.v1.kv_offload.tiering.base, sglang.srt.mem_cache.hicache_storage, lmcache.v1.storage_backend.abstract_backend"

install: $(STAMP)

# KVBLOCK_NO_SKIPS: with everything installed, a skipped test fails (tests/conftest.py).
test: $(STAMP)
	KVBLOCK_NO_SKIPS=1 $(PY) -m pytest $(if $(filter-out 1,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile --max-worker-restart=0) $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/kvblock demo

# The benchmark suite (needs root for loop devices and fio); writes
# .benchmarks/latest.json, then docs/BENCH.md and PNG plots under docs/bench/.
bench: $(STAMP)
	mkdir -p .benchmarks
	$(PY) -m pytest perf/ --benchmark-only --benchmark-json=.benchmarks/latest.json $(PYTEST_ARGS)
	$(VENV)/bin/kvblock report .benchmarks/latest.json --out docs/bench --markdown docs/BENCH.md

clean:
	rm -rf build .pytest_cache .hypothesis .benchmarks

distclean: clean
	rm -rf $(VENV) .kvblock
