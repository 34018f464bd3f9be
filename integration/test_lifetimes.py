"""Dropping the last reference to a DTensor frees its shards on the workers; a shallow copy shares them."""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import textwrap
import time
import weakref

import torch

import dtorch
from dtorch import Shard


def live(cluster, settle_s: float = 2.0):
    """This session's tensors and the workers' bytes, once they stop changing (at most `settle_s`): an earlier
    test's deletes may still be on their way (they go out with later batches) and land in the middle of a test. The
    count is the session's own: the workers' count took in other sessions' tensors, which the controller frees when
    an abandoned session times out, at any time (once, 24 of them in the middle of a test)."""
    deadline, last = time.monotonic() + settle_s, None
    while True:
        cluster.sync()
        status = dtorch.status()
        mine = next(s.tensors for s in status.sessions if s.session == cluster.id)
        now = mine, sum(w.bytes for w in status.workers)
        if now == last or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(0.05)


def test_dropping_dtensors_frees_worker_memory(cluster, mesh4):
    gc.collect()
    base_count, base_bytes = live(cluster)
    xs = [dtorch.zeros(256, 256, device_mesh=mesh4, placements=[Shard(0)]) for _ in range(5)]
    ys = [x + 1 for x in xs]
    count, nbytes = live(cluster)
    assert count - base_count == 10
    assert nbytes - base_bytes == 10 * 256 * 256 * 4
    del xs, ys
    gc.collect()
    count, nbytes = live(cluster)
    assert (count, nbytes) == (base_count, base_bytes)


def test_temporaries_of_redistribution_are_freed(cluster, mesh4):
    gc.collect()
    base = live(cluster)
    a = dtorch.distribute_tensor(torch.randn(8, 8), mesh4, [Shard(0)])
    b = dtorch.distribute_tensor(torch.randn(8, 8), mesh4, [Shard(1)])
    c = a @ b  # needs input redistribution into temporaries
    assert torch.allclose(c.to_torch(), a.to_torch() @ b.to_torch(), atol=1e-5)
    del a, b, c
    gc.collect()
    assert live(cluster)[0] == base[0]  # (the session's count: other sessions' frees do not touch it)


def test_copy_copy_shares_the_data_as_torchs_does(cluster, mesh4):
    ref = torch.arange(8.0).requires_grad_()
    x = dtorch.distribute_tensor(torch.arange(8.0), mesh4, [Shard(0)]).requires_grad_()
    c, rc = copy.copy(x), copy.copy(ref)  # torch's default pickled the DTensor whole into a plain tensor
    assert isinstance(c, dtorch.DTensor) and c.placements == x.placements and c.device_mesh == mesh4
    assert c.requires_grad == rc.requires_grad and c.is_leaf == rc.is_leaf and c._tid != x._tid
    with torch.no_grad():
        c.add_(1)
        rc.add_(1)
    assert torch.equal(x.to_torch(), ref.detach())  # the write through the copy shows in the original
    del c
    gc.collect()
    assert torch.equal(x.to_torch(), ref.detach())  # dropping the copy keeps the original's data


def test_a_read_whose_early_pull_missed_keeps_nothing_alive(cluster, mesh1):
    """A read whose early pull missed (it went where the client last saw a device that has moved since) re-raised
    the miss in the caller's frame, and the session kept that exception in its last early read's future: its
    traceback kept the caller's frames, their DTensors and so their shards on the workers until the next read."""

    def where(device: int) -> str:
        return next(s for s in dtorch.status().sessions if s.session == cluster.id).devices[device]

    def read_after_moves() -> list[weakref.ref]:
        first = dtorch.distribute_tensor(torch.arange(8.0), mesh1, [Shard(0)])
        home, other = where(0), where(1)
        assert dtorch.migrate(0, other).ok
        second = dtorch.distribute_tensor(torch.arange(12.0), mesh1, [Shard(0)])  # the client learns `other`
        assert dtorch.migrate(0, home).ok
        assert torch.equal(first.to_torch(), torch.arange(8.0))  # its early pull goes to `other`: a miss
        return [weakref.ref(first), weakref.ref(second)]

    refs = read_after_moves()
    gc.collect()
    assert [r() for r in refs] == [None, None]


UPLOAD_THEN_STREAM = textwrap.dedent("""
    import time, weakref
    import numpy as np
    import torch
    import dtorch
    from dtorch import Shard

    dtorch.connect(workers=2)
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    source = np.arange(32.0, dtype=np.float32).reshape(8, 4)  # a torch tensor over it keeps it alive
    alive = weakref.ref(source)
    u = dtorch.distribute_tensor(torch.from_numpy(source), mesh, [Shard(0)])
    del source
    v = u * 2
    t0 = time.monotonic()
    while alive() is not None and time.monotonic() - t0 < 10:  # no sync point meanwhile
        time.sleep(0.01)
    print("let go", alive() is None, f"after {time.monotonic() - t0:.2f} s")
    print("value", torch.equal(v.to_torch(), torch.arange(32.0).reshape(8, 4) * 2))
""")


def test_the_client_lets_go_of_an_uploads_source_once_its_copies_are_made_before_any_sync_point():
    """`_uploads` rule 1: the client keeps each upload's source for a rebuild to ask for again only until the
    controller says its copies are made, in a keep-alive's or a Submit's answer (before: until the next sync point,
    however long a program streamed without one: a whole data loader's worth of batches); and, where the controller
    rebuilds nothing (recovery off), not at all."""
    env = {k: v for k, v in os.environ.items() if k != "DTORCH_CONTROLLER"}
    runs = {snapshots: subprocess.Popen([sys.executable, "-c", UPLOAD_THEN_STREAM], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True,
                                        env={**env, "DTORCH_SNAPSHOT_BATCHES": snapshots})
            for snapshots in ("32", "0")}
    out = {snapshots: p.communicate(timeout=120) for snapshots, p in runs.items()}
    assert all(p.returncode == 0 for p in runs.values()), {k: err for k, (_, err) in out.items()}
    for snapshots, (stdout, _) in out.items():  # with recovery off, nothing would ever tell the client to let go
        let_go, value = stdout.split("\n")[:2]
        assert let_go.startswith("let go True") and value == "value True", (snapshots, stdout)
