# kvblock: `make demo` runs the main job, `make test` the test suite.
# Both install what they need: Debian packages (when root), a virtualenv in
# .venv, torch pinned to the CPU build, and kvblock itself (editable).

VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.kvblock-installed
APT_PKGS := liburing-dev pkg-config cmake fio util-linux fdisk e2fsprogs
TORCH   := torch==2.13.0
PYTEST_ARGS ?=

.PHONY: all demo test bench install sysdeps clean distclean

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
$(STAMP): pyproject.toml CMakeLists.txt $(wildcard native/*.c native/*.h) | sysdeps $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test,demo]'
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

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
