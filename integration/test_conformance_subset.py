"""A fast subset of the OpInfo conformance suite (`dtorch.testing.conformance`, full run: `nox -s conformance`).

Each OpInfo in `conformance.SUBSET` runs its first samples on DTensors on a 4-device mesh under
all-Replicate and sharded placements, and must match torch on the full tensors.
"""

from __future__ import annotations

import pytest

from dtorch.testing import conformance


@pytest.fixture(scope="module")
def opinfos():
    return {conformance.op_key(op): op for op in conformance.select_ops(conformance.SUBSET)}


@pytest.mark.parametrize("name", conformance.SUBSET)
def test_opinfo_matches_torch(name, opinfos, mesh4):
    res = conformance.run_op(opinfos[name], mesh4)
    assert res.status == "pass", f"{name}: {res.status}: {res.error} ({res.failing_case})"
    assert res.cases > 0 and res.passed == res.cases
