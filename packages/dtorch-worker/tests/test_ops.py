"""Op names resolve only to registered aten/prims overloads."""

from __future__ import annotations

import pytest
import torch

from dtorch_worker.ops import UnknownOp, resolve_op


def test_resolves_aten_overloads() -> None:
    assert resolve_op("aten.add.Tensor") is torch.ops.aten.add.Tensor
    assert resolve_op("aten.view.default") is torch.ops.aten.view.default
    assert resolve_op("aten._to_copy.default") is torch.ops.aten._to_copy.default
    assert resolve_op("prims.add.default") is torch.ops.prims.add.default


@pytest.mark.parametrize("name", [
    "os.system", "aten.nonexistent.default", "aten.add.nonexistent", "aten.add", "aten.add.Tensor.x",
    "builtins.eval.default", "torch.add.Tensor", "aten.__class__.default", "aten.name.default",
    "aten.add.__class__", "aten.add.overloads", "aten.add.Tensor;import os", "", "aten..default",
    "aten.from_file.default",
])
def test_refuses_non_ops(name: str) -> None:
    with pytest.raises(UnknownOp, match=r"unknown op .*: workers run only registered torch ops"):
        resolve_op(name)


def test_message_names_the_op() -> None:
    with pytest.raises(UnknownOp) as info:
        resolve_op("os.system")
    assert str(info.value).startswith("unknown op 'os.system': workers run only registered torch ops")
