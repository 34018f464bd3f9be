"""One embedded cluster (a real controller and 2 real worker processes) shared by the integration tests."""

from __future__ import annotations

import pytest
import torch

import dtorch


@pytest.fixture(scope="session")
def cluster():
    session = dtorch.connect(workers=2)
    yield session
    dtorch.shutdown()


@pytest.fixture(scope="session")
def mesh1(cluster):
    return dtorch.DeviceMesh("cpu", [0, 1])


@pytest.fixture(scope="session")
def mesh4(cluster):
    """Four logical devices on two workers: virtual devices."""
    return dtorch.DeviceMesh("cpu", [0, 1, 2, 3])


@pytest.fixture(scope="session")
def mesh2d(cluster):
    return dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))


def assert_same(dt, expected, exact=True):
    got = dt.to_torch()
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    if exact:
        assert torch.equal(got, expected), (got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
