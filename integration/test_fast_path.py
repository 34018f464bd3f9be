"""The cached-op fast path (`_dispatch.torch_dispatch`): what keys a cached plan is exactly what changes the
result. Numbers of different types, layouts and dtypes never share a plan; every result matches plain torch."""

from __future__ import annotations

import torch

import dtorch
from _helpers import assert_same
from dtorch import Replicate, Shard


def test_numbers_of_another_type_get_their_own_plan(mesh1):
    t = torch.arange(8)
    x = dtorch.distribute_tensor(t, mesh1, [Shard(0)])
    for _ in range(2):  # the second round runs on cached plans
        assert_same(x + 1, t + 1)
        assert_same(x + 1.5, t + 1.5)  # int64 + float: float32, not a reused int plan
        assert_same(x + True, t + True)
        assert_same(x * 2, t * 2)
        assert_same(x * 2.0, t * 2.0)


def test_layouts_and_dtypes_of_the_operands_get_their_own_plan(mesh1):
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    sa, ra = (dtorch.distribute_tensor(a, mesh1, [p]) for p in (Shard(0), Replicate()))
    sb, rb = (dtorch.distribute_tensor(b, mesh1, [p]) for p in (Shard(0), Replicate()))
    for _ in range(2):
        for x, y in ((sa, sb), (sa, rb), (ra, sb), (ra, rb)):  # a reused plan would read shards as the wrong layout
            assert_same(x + y, a + b)
        assert_same(sa.double() + sb.double(), a.double() + b.double())


def test_the_same_tensor_twice_and_a_chain_of_cached_ops(mesh1):
    t = torch.randn(6)
    x = dtorch.distribute_tensor(t, mesh1, [Shard(0)])
    y, expected = x, t
    for _ in range(50):
        y, expected = y * y - y + 0.5, expected * expected - expected + 0.5
        y, expected = y / (y.abs() + 1), expected / (expected.abs() + 1)
    assert_same(y, expected, exact=False)


def test_wrappers_of_cached_ops_carry_torchs_metadata(mesh1):
    t = torch.randn(4, 6)
    x = dtorch.distribute_tensor(t, mesh1, [Shard(0)])
    for _ in range(2):
        for got, want in ((x + 1, t + 1), (x.t(), t.t()), (x.t() * 2, t.t() * 2), (x.double() - 1, t.double() - 1)):
            assert (got.shape, got.stride(), got.dtype, got.device) == (want.shape, want.stride(), want.dtype,
                                                                          want.device)
            assert_same(got, want)
