"""One embedded cluster (a real controller and 2 real worker processes) shared by the integration tests."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

import dtorch


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_pytests_folder(tmp_path_factory):
    """Every process the tests start (and this one) keeps its temporary files in a folder of pytest's, which keeps
    the last three runs' only: a cluster whose worker a test kills keeps its logs (local_cluster.py), and the suite
    left a dozen such folders in /tmp per run."""
    folder = str(tmp_path_factory.mktemp("tmp"))
    old_env, old_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = folder, folder
    yield
    tempfile.tempdir = old_dir
    if old_env is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = old_env


@pytest.fixture(scope="session", autouse=True)
def _cli_only_through_the_interpreter():
    """In a virtual environment, its bin folder leaves PATH: a test that starts a CLI by its bare name (which works
    only where that folder happens to be on PATH) fails here too; `_helpers.CONTROLLER` and `WORKER` are the way."""
    old = os.environ.get("PATH", "")
    if sys.prefix != sys.base_prefix:
        bindir = os.path.realpath(os.path.dirname(sys.executable))
        os.environ["PATH"] = os.pathsep.join(p for p in old.split(os.pathsep) if os.path.realpath(p) != bindir)
    yield
    os.environ["PATH"] = old


@pytest.fixture(scope="session")
def cluster():
    """The cluster most tests share. Its workers may be silent for 10 s before they count as lost (the default is
    1 s), and its client 30 s before its session closes (the default is 5 s): a loaded 2-core machine, or
    `test_async`'s SIGSTOPped workers, must not cost every later test its workers or its session (once, in a
    whole-suite run, the shared session was closed for silence between two tests). Tests of failure detection
    start clusters of their own."""
    lenient = {"DTORCH_HEARTBEAT_TIMEOUT": "10", "DTORCH_SESSION_TIMEOUT": "30"}
    old = {name: os.environ.get(name) for name in lenient}
    os.environ.update(lenient)
    try:
        session = dtorch.connect(workers=2)
    finally:
        for name, value in old.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
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
