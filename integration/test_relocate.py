"""A client upload to a logical device that moved away follows it: the old worker refuses the Put with the typed
kind MOVED (`wire.RemoteError.kind`, carried across gRPC), the client asks the controller where the device went
and uploads there. Real processes, the shared embedded cluster."""

from __future__ import annotations

import torch

import dtorch
from _helpers import assert_same
from dtorch import Shard, runtime


def _where(device: int) -> str:
    session = runtime.get_session()
    mine = next(s for s in runtime.status().sessions if s.session == session.id)
    return mine.devices[device]


def test_an_upload_to_a_device_that_moved_is_refused_as_moved_and_sent_where_it_went(mesh1):
    first = dtorch.distribute_tensor(torch.arange(8.0), mesh1, [Shard(0)])  # places the mesh, learns addresses
    first.to_torch()
    home, other = _where(0), _where(1)
    assert home != other
    reply = dtorch.migrate(0, other)  # device 0 leaves `home`; the client has not heard of it yet
    assert reply.ok, reply.message
    try:
        x = torch.arange(12.0).reshape(6, 2)
        xd = dtorch.distribute_tensor(x, mesh1, [Shard(0)])  # device 0's shard goes to `home` first: MOVED
        assert_same(xd, x)
        assert _where(0) == other
    finally:
        assert dtorch.migrate(0, home).ok  # the other tests' layout again
    assert_same(first, torch.arange(8.0))
