"""Repository-wide pytest hooks.

* The test order's seed is printed before the first test and again at the end: pytest-randomly shuffles every
  run, and a run that never ends (or fails) must still say how to repeat its order. (`nox -s tests` runs two test
  processes, each taking the next tests of that order as it finishes one; `-n 0` runs the whole order in one.)
* A hard bound per test. pytest-timeout's signal method cannot interrupt a thread stuck in C code (a collective,
  a lock taken inside a C extension), so each test also arms `faulthandler`, from a thread of its own: past its
  timeout plus a grace, every thread's stack goes to the terminal and the run ends with an error, instead of
  hanging until CI's own limit.
"""

from __future__ import annotations

import faulthandler
import os

import pytest

HARD_BOUND_GRACE_S = 120
_STDERR = pytest.StashKey()  # the terminal's stderr, kept where output capture cannot take it


def _order(config) -> str | None:
    seed = getattr(config.option, "randomly_seed", None)
    return (f"test order: pytest -p randomly --randomly-seed={seed} -n 0 repeats it in one process"
            if isinstance(seed, int) else None)


def pytest_configure(config) -> None:
    # global capture is suspended here: fd 2 is still the terminal's, and stays so in this copy
    config.stash[_STDERR] = os.fdopen(os.dup(2), "w")


def pytest_unconfigure(config) -> None:
    config.stash[_STDERR].close()


def pytest_sessionstart(session) -> None:
    line = _order(session.config)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if line and reporter is not None and not hasattr(session.config, "workerinput"):  # (not in xdist's workers)
        reporter.write_line(line)


def _ini_timeout(config) -> float:
    try:
        return float(config.getini("timeout") or 0)
    except ValueError:  # no pytest-timeout (an offline GPU image: integration/gpu_offline.sh): no ini timeout
        return 0.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    marker = item.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker and marker.args else _ini_timeout(item.config)
    if timeout > 0:
        faulthandler.dump_traceback_later(timeout + HARD_BOUND_GRACE_S, exit=True,
                                          file=item.config.stash[_STDERR])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_terminal_summary(terminalreporter, config) -> None:
    line = _order(config)
    if line:
        terminalreporter.write_line(line)
