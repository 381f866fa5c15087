# The two commands of the README. Each creates its own environment (.venv) from a clean
# clone: torch==2.13.0 first (a CPU build; an unpinned torch would pull GBs of CUDA), then
# fastload itself, editable, with its C++ extension built by pip. editable_mode=compat puts
# the clone on sys.path through a .pth file, so the clone's fastload/ package is found by the
# ordinary path search: the default (strict) mode's import hook runs after that search, and a
# directory named fastload in the current directory (the clone, seen from its parent) would
# win as a namespace package ("module 'fastload' has no attribute 'Loader'").
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fastload-installed

.PHONY: demo test install clean
demo: $(STAMP)
	$(VENV)/bin/fastload demo

test: $(STAMP)
	$(PY) -m pytest

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

clean:
	rm -rf build *.egg-info fastload/_C*.so fastload-demo
