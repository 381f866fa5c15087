"""Python's cyclic garbage collector, made to walk only what the running test module made. A
pytest plugin of tests/conftest.py.

The pytest process of a whole-suite run holds a heap that lives for the session: torch's,
pyarrow's, Ray's and Lightning's modules, every collected test, the session fixtures (some
300,000 objects after the first modules). Each full collection walked all of it, ~0.2 s on
2 cores: CPython's own (one each time the long-lived objects grow by a quarter) and every
test's ``gc.collect()`` (tests/test_unheld_owner.py collects between batches, on purpose).
Measured on four files (test_loader, test_ring, test_unheld_owner, test_store): 83 such
collections took 14.4 s of a 38.6 s run.

Here, before the first test of each module is set up (the module before it has torn its
fixtures down by then), the garbage made so far is collected and what survives is frozen
(``gc.freeze()``: moved to a generation no collection walks). A collection then walks what
the current module made, so a test's ``gc.collect()`` still frees every cycle that test (or
its module) dropped, finalizers and weak-reference callbacks included: what is frozen was
reachable at a module boundary, and a reference from it keeps an object alive as before.
The one difference: a cycle of objects frozen at a boundary and dropped later (a session
cache's entry) is not collected before the process ends, which costs memory only.
"""
from __future__ import annotations

import gc

import pytest

_module = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    module = getattr(item, "module", None)
    if module is _module[0]:
        return
    _module[0] = module
    gc.collect()
    gc.freeze()


def pytest_sessionfinish() -> None:
    gc.unfreeze()  # (a process that goes on after pytest.main() gets its collector back whole)
