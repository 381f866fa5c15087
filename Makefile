# The two commands of the README. Each creates its own environment (.venv) from a clean
# clone: torch==2.13.0 first (a CPU build; an unpinned torch would pull GBs of CUDA), then
# fastload itself, editable, with its C++ extension built by pip.
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
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

clean:
	rm -rf build *.egg-info fastload/_C*.so fastload-demo
