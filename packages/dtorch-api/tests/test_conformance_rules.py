"""The rules of the conformance suite (no cluster): placement combinations, comparison, random ops."""

from __future__ import annotations

import pytest
import torch

from dtorch import Partial, Replicate, Shard
from dtorch.testing import conformance


def test_placement_combos_replicate_first_then_shardable_dims():
    combos = conformance.placement_combos([torch.Size([4, 1, 3]), torch.Size([3])], max_combos=3)
    assert combos[0] == (Replicate(), Replicate())
    assert combos[1:] == [(Shard(0), Replicate()), (Shard(0), Shard(0)), (Shard(2), Replicate())]
    assert conformance.placement_combos([torch.Size([])]) == [(Replicate(),)]  # 0-d: nothing to shard
    assert conformance.placement_combos([torch.Size([1, 1])]) == [(Replicate(),)]
    with_partial = conformance.placement_combos([torch.Size([5])], partial_at=0)
    assert with_partial == [(Replicate(),), (Shard(0),), (Partial(),)]


def test_compare_tolerances_dtypes_and_structure():
    a = torch.randn(3, 4)
    conformance.compare((a + 1e-6, 2.0), (a, 2.0))
    with pytest.raises(conformance._Mismatch, match="not close"):
        conformance.compare(a + 1e-2, a)
    with pytest.raises(conformance._Mismatch, match="int32"):
        conformance.compare(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(conformance._Mismatch):  # integers compare exactly
        conformance.compare(torch.tensor([1, 2]), torch.tensor([1, 3]))
    with pytest.raises(conformance._Mismatch, match="outputs"):
        conformance.compare([a, a], [a])
    conformance.compare(torch.zeros(2), torch.ones(2), values=False)  # random ops: shapes and dtypes only


def test_uncomparable_names():
    for name in ("normal", "normal.number_mean", "randn_like", "empty_like", "nn.functional.dropout", "bernoulli",
                 "nn.functional.feature_alpha_dropout.with_train", "new_empty_strided"):
        assert conformance.UNCOMPARABLE.match(name), name
    for name in ("nn.functional.normalize", "__rand__", "native_dropout_backward", "signal.windows.exponential",
                 "nn.functional.feature_alpha_dropout.without_train", "add"):
        assert not conformance.UNCOMPARABLE.match(name), name


def test_report_counts_and_markdown(tmp_path):
    results = [conformance.OpResult("add", "pass", cases=3, passed=3),
               conformance.OpResult("foo", "fail", error="RemoteOpError: aten.foo failed: boom"),
               conformance.OpResult("bar", "not-supported", error="NotImplementedError: dtorch: aten.bar")]
    json_path, md_path = conformance.write_report(results, str(tmp_path), {"seconds": 1.0})
    text = open(md_path).read()
    assert "| pass | 1 |" in text and "| fail | 1 |" in text and "`foo`" in text and "boom" in text
    assert conformance.summarize(results) == {"pass": 1, "fail": 1, "not-supported": 1, "total": 3}
