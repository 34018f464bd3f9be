"""Repository-wide pytest hooks."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter, config) -> None:
    """pytest-randomly shuffles the order of every run; name the seed even under -q, so a failure that depends on
    the order can be repeated."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int):
        terminalreporter.write_line(f"test order: pytest -p randomly --randomly-seed={seed} repeats it")
