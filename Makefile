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

.PHONY: demo test install docs clean
demo: $(STAMP)
	$(VENV)/bin/fastload demo

# The suite on TEST_WORKERS processes (pytest-xdist), each test file's tests in one of them (a
# module's fixtures made once): 2 keeps a 2-core machine busy (much of the suite waits on the
# processes and servers it starts). TEST_WORKERS=0: every test in the one pytest process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

install: $(STAMP)

# The documentation site into site/ (docs/, mkdocs.yml): the docs extra on top of the same .venv.
# --strict: a broken link, a page missing from the nav or a docstring the API reference cannot
# parse fails the build.
DOCS_STAMP := $(VENV)/.fastload-docs-installed
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,docs]' --config-settings editable_mode=compat
	touch $(DOCS_STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

clean:
	rm -rf build *.egg-info fastload/_C*.so fastload-demo site
