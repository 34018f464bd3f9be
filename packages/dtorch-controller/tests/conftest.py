"""Fixtures of the core's tests; the harness and helpers themselves live in `_core_helpers`."""

from __future__ import annotations

import pytest

from _core_helpers import Harness, is_refusal


@pytest.fixture
def h() -> Harness:
    return Harness()


@pytest.fixture
def make_harness():
    return Harness


@pytest.fixture
def refused():
    return is_refusal
