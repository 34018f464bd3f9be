"""Shared assertions for the integration tests."""

from __future__ import annotations

import torch


def assert_same(dt, expected, exact=True):
    got = dt.to_torch()
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    if exact:
        assert torch.equal(got, expected), (got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
