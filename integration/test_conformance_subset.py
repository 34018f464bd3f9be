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


@pytest.mark.parametrize("name,inplace", [("cumsum", True), ("softmax", False), ("tril", True), ("addmm", True),
                                          ("std", False), ("nonzero", False), ("linalg.det", False),
                                          ("msort", False)])
def test_out_and_in_place_variants_write_their_target(name, inplace, mesh4):
    """out= tensors laid out unlike the result (Shard(0) out of a cumsum over dim 0) still get the values, and
    in-place variants (`cumsum_` on a Shard(0) self: moved, run, written back) leave torch's result in self. torch's
    own temporaries that an out= op of a DTensor writes (`linalg.det`'s LU and pivots, `msort`'s indices: their
    storage cannot grow) get a fresh one (before: "Trying to resize storage that is not resizable")."""
    op = conformance.select_ops([name])[0]
    assert (op.inplace_variant is not None) == inplace
    res = conformance.run_op(op, mesh4, max_samples=2, max_combos=1, variants=True)
    assert res.out == "pass", f"{name}: {res.out}"
    assert res.inplace == ("pass" if inplace else ""), f"{name}_: {res.inplace}"


GRADIENTS = ("add", "mul", "div.no_rounding_mode", "where", "pow", "sum", "mean", "amax", "var", "softmax", "cumsum",
             "matmul", "addmm", "nn.functional.linear", "view", "permute", "expand_as", "cat", "split", "gather",
             "scatter_add", "index_select", "index_put", "masked_fill", "nn.functional.layer_norm",
             "nn.functional.embedding", "nn.functional.cross_entropy", "nn.functional.mse_loss")


@pytest.mark.parametrize("name", GRADIENTS)
def test_opinfo_gradients_match_torch(name, mesh4):
    """Gradients of every float input, sharded and replicated, against torch's (`--grad`: `scatter_add`'s, a gather
    with a shorter index, was wrong until session 26)."""
    op = conformance.select_ops([name])[0]
    res = conformance.run_op(op, mesh4, max_samples=2, grad=True)
    assert res.status == "pass", f"{name}: {res.status}: {res.error} ({res.failing_case})"
    assert res.grad == "pass", f"{name}: {res.grad}"


ERRORS = ("uniform", "normal.in_place", "gather", "scatter_add", "index_add", "nn.functional.embedding", "masked_fill",
          "reshape", "narrow", "nn.functional.max_unpool2d")


@pytest.mark.parametrize("name", ERRORS)
def test_opinfo_error_inputs_raise_as_in_torch(name, mesh4):
    """Each OpInfo's error inputs (`--errors`) raise on DTensors, replicated and sharded, as they do in torch, at the
    call or the next sync: `uniform_(3, -1)` and `normal_(std=-1)` on a sharded tensor gave values until session 37."""
    op = conformance.select_ops([name])[0]
    res = conformance.run_op(op, mesh4, max_samples=0, errors=True)
    assert res.errors == "pass", f"{name}: {res.errors}"
