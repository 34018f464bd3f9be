"""One embedded cluster (a real controller and 2 real worker processes) shared by the integration tests."""

from __future__ import annotations

import pytest

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
