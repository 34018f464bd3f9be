"""Redistributions on collectives between real workers (in this process, real gloo groups over TCP).

The commands come from the controller's lowering (`dtorch_controller.core.collectives`, pure); every result is
compared bit for bit with torch on the full tensors, the Partial ones reduced in mesh order (as the
point-to-point plan does): uneven and empty shards, virtual devices, 1-d and 2-d meshes, every reduce op.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import weakref

import pytest
import torch

from dtorch_controller.core import collectives as lowering
from dtorch_protocol.layout import coords, shard_box
from dtorch_protocol.messages import CmdAbandon, CmdFence, CmdGroup, CollectiveStep, Execute, GroupOp
from dtorch_protocol.placement_types import Partial, Replicate, Shard
from dtorch_protocol.values import dtype_name, reduce_in_order
from dtorch_worker.collectives import spelled_out
from dtorch_worker.server import WorkerHandle, start_worker
from dtorch_worker.store import Poison

S = "sess-collectives"
_SESSIONS = itertools.count()


@pytest.fixture(scope="module")
def workers():
    ws = [start_worker() for _ in range(3)]
    yield ws
    for w in ws:
        w.stop()
    for w in ws:  # process groups of aborted ops go before the process does (bounded by the ops' timeouts)
        w.executor.groups.stop(reap_s=30.0)


class Cluster:
    """Workers fed Execute batches in one global order, as the controller does (rule 4 of groups.py)."""

    def __init__(self, ws: list[WorkerHandle], session: str = "") -> None:
        self.ws, self.session = ws, session or f"{S}-{next(_SESSIONS)}"  # a group's rendezvous is per session
        self.groups = lowering.CommGroups()
        self.members = {f"w{i}": lowering.Member(w.address, w.executor.groups.rendezvous) for i, w in enumerate(ws)}
        self.worker = {f"w{i}": w for i, w in enumerate(ws)}

    def send(self, cmds: dict[str, list]) -> dict[str, int]:
        seqs = {}
        for wid, batch in cmds.items():
            w = self.worker[wid]
            seq = w.executor._executed + len(w.executor._pending) + 1
            assert w.executor.submit(Execute(seq=seq, session=self.session, cmds=batch))
            seqs[wid] = seq
        return seqs

    def wait(self, seqs: dict[str, int], timeout: float = 60.0) -> None:
        for wid, seq in seqs.items():
            assert self.worker[wid].executor.wait_completed(seq, timeout), f"{wid} did not finish batch {seq}"


def shards_of(shape, mesh_shape, placements, full_by_partial, devices):
    """Device -> its shard: the box of the (partial) full value it holds."""
    cs = coords(mesh_shape)
    pdims = [k for k, p in enumerate(placements) if p.is_partial()]
    out = {}
    for flat, d in enumerate(devices):
        c = cs[flat]
        full = full_by_partial[tuple(c[k] for k in pdims)]
        box = shard_box(tuple(shape), tuple(mesh_shape), tuple(placements), c)
        t = full
        for dim, (start, length) in enumerate(box):
            t = t.narrow(dim, start, length)
        out[d] = t.clone()
    return out


def redistribute(cluster: Cluster, shape, mesh_shape, binding, src, dst, dtype=torch.float32, tid=(1, 2), seed=0):
    """Put random (partial) shards of `src`, run the lowered redistribution, return (got, expected) per device."""
    shape, mesh_shape, src, dst = tuple(shape), tuple(mesh_shape), tuple(src), tuple(dst)
    devices = tuple(range(math.prod(mesh_shape)))
    g = torch.Generator().manual_seed(seed)
    src_pdims = [k for k, p in enumerate(src) if p.is_partial()]
    combos = list(itertools.product(*(range(mesh_shape[k]) for k in src_pdims)))

    def rand():
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) > 0.5
        if dtype.is_floating_point:
            return (torch.randn(shape, generator=g) * 10).to(dtype)
        return torch.randint(-50, 50, shape, generator=g).to(dtype)

    partials = {c: rand() for c in combos}
    for d, t in shards_of(shape, mesh_shape, src, partials, devices).items():
        cluster.worker[binding[d]].store.put((cluster.session, tid[0], d), t)
    # expected: reduce in row-major order over the reduced dims, per combination of the kept partial dims
    reduced = [k for k in src_pdims if dst[k] != src[k]]
    kept = [k for k in src_pdims if k not in reduced]
    op = src[reduced[0]].reduce_op if reduced else "sum"
    full_by_kept = {}
    for ck in itertools.product(*(range(mesh_shape[k]) for k in kept)):
        members = [c for c in combos if all(c[src_pdims.index(k)] == v for k, v in zip(kept, ck))]
        full_by_kept[ck] = reduce_in_order([partials[c].clone() for c in members], op) if reduced else \
            partials[members[0]]
    expected = shards_of(shape, mesh_shape, dst, full_by_kept if kept else {(): full_by_kept[()]}, devices) \
        if not kept else _kept_shards(shape, mesh_shape, dst, full_by_kept, kept, devices)
    low = lowering.lower(tuple(shape), dtype_name(dtype), (devices, tuple(mesh_shape)), tuple(src), tuple(dst),
                         tuple(sorted(binding.items())), tuple((w, "cpu", True) for w in sorted(cluster.worker)))
    assert low is not None, (src, dst)
    cs = coords(mesh_shape)
    shapes = ({d: list(t.shape) for d, t in shards_of(shape, mesh_shape, src, partials, devices).items()},
              {d: [n for _s, n in shard_box(tuple(shape), tuple(mesh_shape), tuple(dst), cs[d])] for d in devices})
    cmds = lowering.commands(low, cluster.groups, cluster.members, tid[0], tid[1], dtype_name(dtype), shapes,
                             src_line="test.py:1", timeout_s=20.0)
    cluster.wait(cluster.send(cmds))
    got = {d: cluster.worker[binding[d]].store.get((cluster.session, tid[1], d)) for d in devices}
    return got, expected, low


def _kept_shards(shape, mesh_shape, dst, full_by_kept, kept, devices):
    cs = coords(mesh_shape)
    out = {}
    for flat, d in enumerate(devices):
        c = cs[flat]
        full = full_by_kept[tuple(c[k] for k in kept)]
        t = full
        for dim, (start, length) in enumerate(shard_box(tuple(shape), tuple(mesh_shape), tuple(dst), c)):
            t = t.narrow(dim, start, length)
        out[d] = t
    return out


def check(got, expected):
    for d in expected:
        assert isinstance(got[d], torch.Tensor), (d, got[d])
        assert got[d].shape == expected[d].shape and got[d].dtype == expected[d].dtype, (d, got[d], expected[d])
        assert torch.equal(got[d], expected[d]), (d, got[d], expected[d])


ONE_D = [
    ([Partial("sum")], [Replicate()]), ([Partial("avg")], [Replicate()]), ([Partial("max")], [Replicate()]),
    ([Partial("min")], [Shard(0)]), ([Partial("sum")], [Shard(1)]), ([Shard(0)], [Replicate()]),
    ([Shard(1)], [Replicate()]), ([Shard(0)], [Shard(1)]), ([Shard(1)], [Shard(0)]), ([Replicate()], [Shard(1)]),
]


@pytest.mark.parametrize("src,dst", ONE_D, ids=[f"{a[0]}->{b[0]}" for a, b in ONE_D])
def test_one_dim_on_three_workers_uneven(workers, src, dst):
    cluster = Cluster(workers)
    binding = {0: "w0", 1: "w1", 2: "w2"}
    got, expected, low = redistribute(cluster, (7, 5), (3,), binding, src, dst)
    check(got, expected)
    kinds = [step.kind for step, _groups in low.steps]
    kind = lambda p: "S" if p.is_shard() else "P" if p.is_partial() else "R"  # noqa: E731
    assert kinds == [{("P", "R"): "all_reduce", ("P", "S"): "reduce_scatter", ("S", "R"): "all_gather",
                      ("S", "S"): "all_to_all", ("R", "S"): "slice"}[(kind(src[0]), kind(dst[0]))]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.bool, torch.bfloat16, torch.complex64])
def test_dtypes_travel_as_bytes(workers, dtype):
    cluster = Cluster(workers)
    src, dst = ([Partial("max")], [Replicate()]) if dtype not in (torch.complex64,) else ([Shard(0)], [Replicate()])
    if dtype == torch.bool:
        src = [Shard(1)]
    got, expected, _ = redistribute(cluster, (4, 6), (3,), {0: "w0", 1: "w1", 2: "w2"}, src, dst, dtype=dtype)
    check(got, expected)


def test_virtual_devices_combine_locally(workers):
    """Four logical devices on two workers (0 and 2 on w0): positions of a rank travel together."""
    cluster = Cluster(workers)
    binding = {0: "w0", 1: "w1", 2: "w0", 3: "w1"}
    for src, dst in [([Partial("sum")], [Replicate()]), ([Shard(0)], [Replicate()]), ([Shard(0)], [Shard(1)]),
                     ([Partial("avg")], [Shard(0)])]:
        got, expected, _ = redistribute(cluster, (9, 6), (4,), binding, src, dst, seed=3)
        check(got, expected)


def test_uneven_rank_counts_and_empty_shards(workers):
    """Three devices on two workers, and a tensor dim shorter than the mesh (empty shards)."""
    cluster = Cluster(workers)
    binding = {0: "w0", 1: "w1", 2: "w0"}
    for src, dst in [([Shard(0)], [Replicate()]), ([Partial("sum")], [Shard(0)]), ([Shard(0)], [Shard(1)]),
                     ([Partial("min")], [Replicate()])]:
        got, expected, _ = redistribute(cluster, (2, 7), (3,), binding, src, dst, seed=5)
        check(got, expected)


TWO_D = [
    ([Shard(0), Partial("sum")], [Shard(0), Replicate()]),  # the TP row-parallel output
    ([Partial("sum"), Replicate()], [Replicate(), Replicate()]),  # the DP gradient
    ([Partial("sum"), Partial("sum")], [Replicate(), Replicate()]),  # one reduction over both dims
    ([Partial("avg"), Shard(1)], [Replicate(), Replicate()]),
    ([Shard(0), Shard(0)], [Replicate(), Replicate()]),  # nested: inner dim first
    ([Replicate(), Replicate()], [Shard(0), Shard(0)]),
    ([Shard(1), Shard(0)], [Shard(0), Replicate()]),  # the gather must come first
    ([Partial("sum"), Shard(0)], [Shard(1), Replicate()]),
]


@pytest.mark.parametrize("src,dst", TWO_D, ids=[f"{a}->{b}" for a, b in TWO_D])
@pytest.mark.parametrize("binding", [{0: "w0", 1: "w1", 2: "w2", 3: "w0"}, {0: "w0", 1: "w1", 2: "w0", 3: "w1"}],
                         ids=["3workers", "2workers"])
def test_two_dim_meshes(workers, src, dst, binding):
    cluster = Cluster(workers)
    got, expected, _ = redistribute(cluster, (6, 5), (2, 2), binding, src, dst, seed=7)
    check(got, expected)


def test_ops_of_a_group_run_in_its_order_and_a_gap_is_refused(workers):
    cluster = Cluster(workers)
    binding = {0: "w0", 1: "w1"}
    redistribute(cluster, (4,), (2,), binding, [Shard(0)], [Replicate()], tid=(10, 11))
    cg = next(iter(cluster.groups.groups.values()))
    cg.seq += 1  # the controller "skips" an op: the members refuse the next one
    low = lowering.lower((4,), "float32", ((0, 1), (2,)), (Shard(0),), (Replicate(),), ((0, "w0"), (1, "w1")),
                         (("w0", "cpu", True), ("w1", "cpu", True), ("w2", "cpu", True)))
    shapes = ({0: [2], 1: [2]}, {0: [4], 1: [4]})
    cluster.wait(cluster.send(lowering.commands(low, cluster.groups, cluster.members, 10, 12, "float32", shapes)))
    value = workers[0].store.get((cluster.session, 12, 0))
    assert isinstance(value, Poison) and "arrived after op" in value.report.message, value


def test_a_poisoned_input_poisons_every_output_with_the_original_report(workers):
    """The worker with the poisoned shard still takes part: nobody waits, every output carries its report."""
    cluster = Cluster(workers, session="sess-poison")
    binding = {0: "w0", 1: "w1", 2: "w2"}
    report = __import__("dtorch_protocol.messages", fromlist=["ErrorReport"]).ErrorReport(
        op="aten.div.Tensor", src="user.py:7", message="boom", tid=20)
    for d in range(3):
        cluster.worker[binding[d]].store.put(("sess-poison", 20, d), torch.ones(2, 3) if d != 1 else Poison(report))
    low = lowering.lower((6, 3), "float32", ((0, 1, 2), (3,)), (Shard(0),), (Replicate(),),
                         tuple(sorted(binding.items())), tuple((w, "cpu", True) for w in ("w0", "w1", "w2")))
    shapes = ({d: [2, 3] for d in range(3)}, {d: [6, 3] for d in range(3)})
    cluster.wait(cluster.send(lowering.commands(low, cluster.groups, cluster.members, 20, 21, "float32", shapes)))
    for d in range(3):
        value = cluster.worker[binding[d]].store.get(("sess-poison", 21, d))
        assert isinstance(value, Poison) and value.report == report, (d, value)
    assert not any(w.executor.take_errors().get("sess-poison") for w in workers)  # the user sees it once


def test_a_peer_that_never_arrives_fails_within_the_bound_naming_it(workers):
    """The group meets and runs one op; of its second op, only two of three members get theirs: they fail after
    the group's timeout, naming the third, and the report carries the user's source line."""
    cluster = Cluster(workers, session="sess-missing")
    binding = {0: "w0", 1: "w1", 2: "w2"}
    for d in range(3):
        cluster.worker[binding[d]].store.put(("sess-missing", 30, d), torch.ones(2))
    low = lowering.lower((6,), "float32", ((0, 1, 2), (3,)), (Shard(0),), (Replicate(),),
                         tuple(sorted(binding.items())), tuple((w, "cpu", True) for w in ("w0", "w1", "w2")))
    shapes = ({d: [2] for d in range(3)}, {d: [6] for d in range(3)})
    first = lowering.commands(low, cluster.groups, cluster.members, 30, 31, "float32", shapes, timeout_s=5.0)
    cluster.wait(cluster.send(first))
    assert torch.equal(workers[0].store.get(("sess-missing", 31, 0)), torch.ones(6))
    cmds = lowering.commands(low, cluster.groups, cluster.members, 30, 32, "float32", shapes, src_line="train.py:9")
    del cmds["w2"]  # w2 never runs its part
    cluster.wait(cluster.send(cmds), timeout=30)  # far less than the 60 s a default group would wait
    for w, d in (("w0", 0), ("w1", 1)):
        value = cluster.worker[w].store.get(("sess-missing", 32, d))
        assert isinstance(value, Poison), value
        msg = value.report.message
        assert msg.startswith("all_gather of tensor 30 into 32 on group g1 (generation 1, 3 workers) timed out "
                              "after 5s waiting for "), msg
        assert msg.endswith(f"w2 at {workers[2].address}"), msg  # the one missing, and only it
        errors = cluster.worker[w].executor.take_errors()["sess-missing"]
        assert errors[0].src == "train.py:9" and errors[0].op == "redistribute", errors


def stuck_all_gather(cluster: Cluster, timeout_s: float) -> dict[str, int]:
    """Tensor 40 (Shard(0) on w0, w1) all-gathered into 41, where w1 joins the group but never runs the op: w0's
    batch is left waiting for it (checked); returns the batches' seqs."""
    for d in range(2):
        cluster.worker[f"w{d}"].store.put((cluster.session, 40, d), torch.ones(2))
    low = lowering.lower((4,), "float32", ((0, 1), (2,)), (Shard(0),), (Replicate(),), ((0, "w0"), (1, "w1")),
                         (("w0", "cpu", True), ("w1", "cpu", True), ("w2", "cpu", True)))
    shapes = ({d: [2] for d in range(2)}, {d: [4] for d in range(2)})
    cmds = lowering.commands(low, cluster.groups, cluster.members, 40, 41, "float32", shapes, timeout_s=timeout_s)
    cmds["w1"] = [c for c in cmds["w1"] if isinstance(c, CmdGroup)]  # w1 never runs the op: w0 waits
    seqs = cluster.send(cmds)
    time.sleep(0.5)
    assert not cluster.worker["w0"].executor.wait_completed(seqs["w0"], 0.1)  # in flight: the batch is not complete
    return seqs


def test_abandon_ends_a_wait_at_once_and_fences_the_groups(workers):
    cluster = Cluster(workers, session="sess-abandon")
    seqs = stuck_all_gather(cluster, timeout_s=10.0)
    cluster.send({"w0": [CmdAbandon(tids=[41])]})
    assert workers[0].executor.wait_completed(seqs["w0"], 8.0)  # before the group's 10 s timeout ran out
    assert not workers[0].executor.take_errors().get("sess-abandon")  # abandoned work reports nothing
    step = CollectiveStep(kind="all_gather", dim=0, src_dim=-1, reduce="sum", ops=[GroupOp(
        group="g1", generation=1, seq=2, rank=0, layout=[[0], [1]], devices={0: 0}, sizes=[2, 2])])
    workers[0].store.put(("sess-abandon", 42, 0), torch.ones(2))
    from dtorch_protocol.messages import CmdCollective
    cluster.wait(cluster.send({"w0": [CmdCollective(src=42, dst=43, dtype="float32", steps=[step],
                                                     in_shapes={0: [2]}, out_shapes={0: [4]})]}))
    value = workers[0].store.get(("sess-abandon", 43, 0))
    assert isinstance(value, Poison) and "was fenced (the session is being rebuilt)" in value.report.message


def test_a_fence_of_a_member_ends_the_wait_for_it_at_once_from_any_namespace(workers):
    """groups.py rule 7: CmdFence names w1, declared lost (a stopped worker keeps its connections open); w0's op
    waiting for it fails at once, saying why, though the fence came in a batch of another namespace (the
    controller sends one per worker). The session is not rebuilt here: the failure is reported."""
    cluster = Cluster(workers, session="sess-fenced")
    seqs = stuck_all_gather(cluster, timeout_s=20.0)
    Cluster(workers, session="#fence").send({"w0": [CmdFence(addresses=[workers[1].address])]})
    assert workers[0].executor.wait_completed(seqs["w0"], 8.0)  # long before the group's 20 s timeout
    value = workers[0].store.get(("sess-fenced", 41, 0))
    assert isinstance(value, Poison) and "was aborted (a member was declared lost)" in value.report.message
    assert workers[0].executor.take_errors()["sess-fenced"][0].op == "redistribute"


def test_outputs_are_waited_for_at_their_first_use_not_at_the_issue(workers):
    """The executor runs on while a collective is in flight; the op that reads its output waits for it."""
    cluster = Cluster(workers, session="sess-overlap")
    binding = {0: "w0", 1: "w1"}
    for d in range(2):
        cluster.worker[binding[d]].store.put(("sess-overlap", 50, d), torch.full((2,), float(d + 1)))
    low = lowering.lower((4,), "float32", ((0, 1), (2,)), (Shard(0),), (Replicate(),), tuple(sorted(binding.items())),
                         (("w0", "cpu", True), ("w1", "cpu", True), ("w2", "cpu", True)))
    shapes = ({d: [2] for d in range(2)}, {d: [4] for d in range(2)})
    cmds = lowering.commands(low, cluster.groups, cluster.members, 50, 51, "float32", shapes)
    late = cmds.pop("w1")
    from dtorch_protocol.messages import CmdCreate, CmdRun
    cmds["w0"] += [CmdCreate(tid=52, dtype="float32", shape=[3], init="ones", boxes={0: [[0, 3]]}),
                   CmdRun(op="aten.add.Tensor", devices=[0], args=[{"$t": 51}, 1.0], kwargs={}, outs=[53])]
    seqs = cluster.send(cmds)
    assert workers[0].store.peek(("sess-overlap", 52, 0)) is None or True
    deadline = time.monotonic() + 10
    while ("sess-overlap", 52, 0) not in workers[0].store and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ("sess-overlap", 52, 0) in workers[0].store  # ran after the issue, while the all_gather waits for w1
    assert ("sess-overlap", 53, 0) not in workers[0].store  # the first use waits
    threading.Timer(0.2, lambda: cluster.send({"w1": late})).start()
    cluster.wait(seqs)
    assert torch.equal(workers[0].store.get(("sess-overlap", 53, 0)), torch.tensor([2.0, 2.0, 3.0, 3.0]))


@pytest.mark.parametrize("then,where", [("read", "dtorch-executor"), ("delete, mesh, read", "dtorch-executor"),
                                        ("nothing", "dtorch-executor"), ("create, read", "dtorch-group-")])
def test_a_collective_needed_at_once_runs_on_the_executor_and_one_read_later_on_its_lane(workers, monkeypatch, then,
                                                                                        where):
    """Groups rule 4: an all_reduce whose output the next command reads (deletes and marks skipped), or that ends
    the work queued, ran on its group's lane while the executor waited for it at once: two thread hand-offs per
    collective, about a tenth of a worker's CPU on a TP forward. It now runs on the executor. One whose output is
    read later still runs on the lane, and overlaps what the executor runs meanwhile."""
    from dtorch_protocol.messages import CmdCreate, CmdDelete, CmdMesh, CmdRun
    from dtorch_worker.groups import Groups

    ran_on: list[str] = []
    run = Groups._run

    def spy(self, g, ctx, fn):  # noqa: ANN001, ANN202
        ran_on.append(threading.current_thread().name)
        return run(self, g, ctx, fn)

    cluster = Cluster(workers)
    binding = {0: "w0", 1: "w1"}
    redistribute(cluster, (4,), (2,), binding, [Partial()], [Replicate()], tid=(58, 59))  # the group, built
    monkeypatch.setattr(Groups, "_run", spy)
    for d in range(2):
        cluster.worker[binding[d]].store.put((cluster.session, 60, d), torch.full((4,), float(d + 1)))
    low = lowering.lower((4,), "float32", ((0, 1), (2,)), (Partial(),), (Replicate(),), tuple(sorted(binding.items())),
                         (("w0", "cpu", True), ("w1", "cpu", True), ("w2", "cpu", True)))
    shapes = ({d: [4] for d in range(2)}, {d: [4] for d in range(2)})
    cmds = lowering.commands(low, cluster.groups, cluster.members, 60, 61, "float32", shapes)
    for wid, d in (("w0", 0), ("w1", 1)):
        cmds[wid] += {"read": [], "nothing": [], "delete, mesh, read": [
            CmdDelete(tids=[60], devices=[d]), CmdMesh(mesh=0, devices=[d])], "create, read": [
            CmdCreate(tid=62, dtype="float32", shape=[1], init="ones", boxes={d: [[0, 1]]})]}[then]
        if then != "nothing":
            cmds[wid].append(CmdRun(op="aten.add.Tensor", devices=[d], args=[{"$t": 61}, 1.0], kwargs={}, outs=[63]))
    cluster.wait(cluster.send(cmds))
    for wid, d in (("w0", 0), ("w1", 1)):
        assert torch.equal(cluster.worker[wid].store.get((cluster.session, 61, d)), torch.full((4,), 3.0))
    assert len(ran_on) == 2 and all(name.startswith(where) for name in ran_on), ran_on


def test_scratch_buffers_are_reused_and_never_shared_with_outputs(workers):
    """Large ops reuse the pool's buffers; an output of one op is not overwritten by the next ones."""
    cluster = Cluster(workers)
    binding = {0: "w0", 1: "w1", 2: "w2"}
    first, expected, _ = redistribute(cluster, (300, 1000), (3,), binding, [Partial("sum")], [Replicate()], seed=11,
                                      tid=(60, 61))
    kept = {d: t.clone() for d, t in first.items()}
    for i, (src, dst) in enumerate([([Shard(0)], [Replicate()]), ([Partial("max")], [Shard(1)]),
                                    ([Shard(1)], [Shard(0)])]):
        got, exp, _ = redistribute(cluster, (300, 1000), (3,), binding, src, dst, seed=12 + i, tid=(62 + 2 * i,
                                                                                                      63 + 2 * i))
        check(got, exp)
    check(first, kept)
    check(first, expected)
    assert workers[0].executor.buffers._kept > 0  # buffers of 1 MiB and more went back to the pool


def test_the_pool_bounds_what_it_keeps_and_hands_out_fitting_buffers():
    from dtorch_worker.collectives import BufferPool

    pool = BufferPool(limit=5 << 20)
    cpu = torch.device("cpu")
    a, b = pool.take(2 << 20, cpu), pool.take(3 << 20, cpu)
    pool.give(a)
    pool.give(b)
    assert pool._kept == 5 << 20
    assert pool.take(1200 << 10, cpu) is a  # the smallest that fits, at most twice the size
    assert pool.take(100, cpu).numel() == 100 and pool._kept == 3 << 20  # small ones are never pooled
    pool.give(a)
    big = pool.take(4 << 20, cpu)
    assert big is not b
    pool.give(big)  # over the limit: the oldest kept (b, then a) go
    assert pool._kept == 4 << 20 and pool.take(4 << 20, cpu) is big


@pytest.mark.parametrize("dtype,binding,native", [
    (torch.float32, {0: "w0", 1: "w1"}, True),  # two values: one addition, the backend's all_reduce
    (torch.float64, {0: "w0", 1: "w1", 2: "w2"}, False),  # three: in mesh order, by hand
    (torch.int64, {0: "w0", 1: "w1", 2: "w0", 3: "w1"}, True),  # integers: any order is exact
    (torch.float32, {0: "w0", 1: "w1", 2: "w0", 3: "w1"}, False),  # virtual devices: a local pre-sum would reorder
])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_the_backends_all_reduce_only_where_it_equals_mesh_order(workers, dtype, binding, native, op):
    from dtorch_worker import collectives

    cluster = Cluster(workers)
    n = len(binding)
    calls = []
    real = collectives._native_all_reduce
    collectives._native_all_reduce = lambda pk: calls.append(pk) or real(pk)
    try:
        got, expected, _ = redistribute(cluster, (5, 3), (n,), binding, [Partial(op)], [Replicate()], dtype=dtype)
    finally:
        collectives._native_all_reduce = real
    check(got, expected)
    assert bool(calls) == native


def test_a_batch_is_told_complete_once_when_its_collective_has_landed(workers):
    """The executor tells the agent of a completion once, when it moved: a batch whose collective is still in flight
    after its commands ran is told when the collective landed (its output then readable), not before."""
    cluster = Cluster(workers)
    told: dict[str, list[tuple[int, bool]]] = {"w0": [], "w1": []}

    def hook(wid: str):  # noqa: ANN202
        key = (cluster.session, 2, int(wid[1]))
        return lambda seq: told[wid].append((seq, isinstance(cluster.worker[wid].store.peek(key), torch.Tensor)))

    for wid in told:
        cluster.worker[wid].executor.on_complete = hook(wid)
    try:
        got, expected, _ = redistribute(cluster, (6, 4), (2,), {0: "w0", 1: "w1"}, [Shard(0)], [Replicate()])
        check(got, expected)
        for wid, calls in told.items():
            seq = cluster.worker[wid].executor.completed
            assert calls == [(seq, True)], (wid, calls)
    finally:
        for wid in told:
            cluster.worker[wid].executor.on_complete = None


def test_poison_reaches_every_rank_through_the_backends_all_reduce(workers):
    cluster = Cluster(workers, session="sess-native-poison")
    binding = {0: "w0", 1: "w1"}
    report = __import__("dtorch_protocol.messages", fromlist=["ErrorReport"]).ErrorReport(
        op="aten.mul.Tensor", src="user.py:3", message="bad", tid=70)
    workers[0].store.put(("sess-native-poison", 70, 0), torch.ones(4))
    workers[1].store.put(("sess-native-poison", 70, 1), Poison(report))
    low = lowering.lower((4,), "float32", ((0, 1), (2,)), (Partial("sum"),), (Replicate(),),
                         tuple(sorted(binding.items())), (("w0", "cpu", True), ("w1", "cpu", True)))
    cmds = lowering.commands(low, cluster.groups, cluster.members, 70, 71, "float32",
                             ({0: [4], 1: [4]}, {0: [4], 1: [4]}))
    cluster.wait(cluster.send(cmds))
    for d in range(2):
        value = cluster.worker[binding[d]].store.get(("sess-native-poison", 71, d))
        assert isinstance(value, Poison) and value.report == report, value


@pytest.mark.parametrize("by_all_to_all", [True, False], ids=["all_to_all of copies", "all_gather"])
def test_both_gather_primitives_give_the_same_values(workers, monkeypatch, by_all_to_all):
    from dtorch_worker.device import DeviceBackend

    monkeypatch.setattr(DeviceBackend, "gather_by_all_to_all", lambda self, ranks: by_all_to_all)
    cluster = Cluster(workers)
    for src, binding in [([Shard(0)], {0: "w0", 1: "w1", 2: "w2"}), ([Shard(1)], {0: "w0", 1: "w1", 2: "w0"})]:
        got, expected, _ = redistribute(cluster, (7, 5), (3,), binding, src, [Replicate()], seed=21)
        check(got, expected)


def test_one_lane_for_every_group_as_on_nccl(monkeypatch):
    """A backend that asks for one lane and polls its Works (what the CUDA backend does, here on gloo): every
    group of every session runs on the worker's one lane, values are the same, and aborting a session's groups
    leaves the lane serving the others."""
    from dtorch_worker import device as dev

    class OneLane(dev.DeviceBackend):
        one_lane = True

        def completion(self, work):
            return dev._Polled(work)

    monkeypatch.setitem(dev._REGISTRY, "cpu", OneLane)
    ws = [start_worker() for _ in range(3)]
    try:
        for src, dst in TWO_D[:3]:
            cluster = Cluster(ws)
            got, expected, _ = redistribute(cluster, (6, 5), (2, 2), {0: "w0", 1: "w1", 2: "w2", 3: "w0"}, src, dst)
            check(got, expected)
        lanes = {g.lane for w in ws for g in w.executor.groups._groups.values()}
        assert lanes == {w.executor.groups._one_lane for w in ws} and len(lanes) == 3
        cluster.wait(cluster.send({w: [CmdAbandon(tids=[])] for w in ("w0", "w1", "w2")}))
        got, expected, _ = redistribute(Cluster(ws), (6, 5), (2, 2), {0: "w0", 1: "w1", 2: "w2", 3: "w0"},
                                        *TWO_D[3])
        check(got, expected)
    finally:
        for w in ws:
            w.stop()
        for w in ws:
            w.executor.groups.stop(reap_s=30.0)


def _big_gather(cluster, src_tid, dst_tid, shards, timeout_s=20.0, dim=0):
    """Commands of an all_gather (Shard(dim) -> Replicate) of `shards` (device -> tensor) on w0 and w1."""
    binding = {0: "w0", 1: "w1"}
    for d, t in shards.items():
        cluster.worker[binding[d]].store.put((cluster.session, src_tid, d), t)
    shape = list(shards[0].shape)
    shape[dim] = sum(t.shape[dim] for t in shards.values())
    low = lowering.lower(tuple(shape), "float32", ((0, 1), (2,)), (Shard(dim),), (Replicate(),),
                         tuple(sorted(binding.items())),
                         (("w0", "cpu", True), ("w1", "cpu", True), ("w2", "cpu", True)))
    shapes = ({d: list(t.shape) for d, t in shards.items()}, {d: list(shape) for d in shards})
    return lowering.commands(low, cluster.groups, cluster.members, src_tid, dst_tid, "float32", shapes,
                             timeout_s=timeout_s)


@pytest.mark.parametrize("dim", [0, 1], ids=["outer dim", "inner dim"])
@pytest.mark.parametrize("by_all_to_all", [True, False], ids=["all_to_all to the peer", "all_gather"])
def test_a_large_even_all_gather_goes_from_the_shards_straight_into_the_output(workers, monkeypatch, by_all_to_all,
                                                                               dim):
    """Rule 7: no send buffer: along the outer dim the output is the tensor the backend wrote, along an inner one
    the ranks' shards are laid into it by one copy; values equal torch, and a poisoned shard still poisons every
    output (its report found in the group's store)."""
    from dtorch_worker import collectives
    from dtorch_worker.device import DeviceBackend

    monkeypatch.setattr(DeviceBackend, "gather_by_all_to_all", lambda self, ranks: by_all_to_all)
    direct = []
    made = collectives._all_gather_direct
    monkeypatch.setattr(collectives, "_all_gather_direct", lambda pk: direct.append(pk.op.rank) or made(pk))
    cluster = Cluster(workers)
    shards = {d: torch.randn(256, 1024, generator=torch.Generator().manual_seed(d)) for d in range(2)}  # 1 MiB each
    cluster.wait(cluster.send(_big_gather(cluster, 70, 71, shards, dim=dim)))
    for w, d in (("w0", 0), ("w1", 1)):
        got = cluster.worker[w].store.get((cluster.session, 71, d))
        assert torch.equal(got, torch.cat([shards[0], shards[1]], dim=dim)), (w, got)
    assert sorted(direct) == [0, 1]
    report = __import__("dtorch_protocol.messages", fromlist=["ErrorReport"]).ErrorReport(
        op="aten.div.Tensor", src="user.py:8", message="boom", tid=72)
    cmds = _big_gather(cluster, 72, 73, shards, dim=dim)
    cluster.worker["w1"].store.put((cluster.session, 72, 1), Poison(report))  # w1 contributes poison
    cluster.wait(cluster.send(cmds))
    for w, d in (("w0", 0), ("w1", 1)):
        value = cluster.worker[w].store.get((cluster.session, 73, d))
        assert isinstance(value, Poison) and value.report == report, (d, value)
    assert len(direct) == 4


def test_a_large_inner_dim_all_gather_on_three_ranks_is_laid_out_by_one_copy(workers, monkeypatch):
    """Rule 7 with the backend's all_gather (three ranks, as on NCCL): a Shard(1) of a 3-d tensor, 1 MiB a rank,
    sent as it lies; the output equals torch's bit for bit."""
    from dtorch_worker import collectives
    from dtorch_worker.device import DeviceBackend

    monkeypatch.setattr(DeviceBackend, "gather_by_all_to_all", lambda self, ranks: False)
    direct = []
    made = collectives._all_gather_direct
    monkeypatch.setattr(collectives, "_all_gather_direct", lambda pk: direct.append(pk.op.rank) or made(pk))
    got, expected, _ = redistribute(Cluster(workers), (2, 768, 512), (3,), {0: "w0", 1: "w1", 2: "w2"}, [Shard(1)],
                                    [Replicate()], seed=41, tid=(95, 96))
    check(got, expected)
    assert sorted(direct) == [0, 1, 2]


def test_an_in_place_write_waits_for_the_collective_sending_straight_from_its_storage(workers):
    """Rule 7: the all_gather sends w0's stored shard itself; an in-place add on it, next in w0's stream, runs only
    once the op is done (w1 joins late), so w1 receives the value from before the add."""
    from dtorch_protocol.messages import CmdRun

    cluster = Cluster(workers)
    shards = {d: torch.full((256, 1024), float(d + 1)) for d in range(2)}
    cmds = _big_gather(cluster, 80, 81, shards)
    cmds["w0"].append(CmdRun(op="aten.add_.Tensor", devices=[0], args=[{"$t": 80}, 10.0], kwargs={}, outs=[80]))
    late = cmds.pop("w1")
    seqs = cluster.send(cmds)
    sent: dict[str, int] = {}
    threading.Timer(0.5, lambda: sent.update(cluster.send({"w1": late}))).start()
    cluster.wait(seqs)  # w0's add ran after the all_gather, which needed w1
    assert sent
    cluster.wait(sent)
    expected = torch.cat([torch.full((256, 1024), 1.0), torch.full((256, 1024), 2.0)])
    assert torch.equal(cluster.worker["w1"].store.get((cluster.session, 81, 1)), expected)
    assert torch.equal(cluster.worker["w0"].store.get((cluster.session, 81, 0)), expected)
    assert torch.equal(cluster.worker["w0"].store.get((cluster.session, 80, 0)), torch.full((256, 1024), 11.0))


@pytest.mark.parametrize("src,dst", [([Partial("sum")], [Replicate()]), ([Partial("max")], [Shard(0)]),
                                     ([Shard(1)], [Shard(0)])], ids=str)
def test_large_exchanges_send_the_shards_as_they_are(workers, monkeypatch, src, dst):
    """Rule 7 on three workers: pieces lying back to back in the shard travel without a send buffer (the
    all_reduce's reduce-scatter, a reduce_scatter, an all_to_all of rows); values equal torch bit for bit, and a
    poisoned shard still poisons every output."""
    from dtorch_worker import collectives

    sent = []
    real = collectives._back_to_back
    monkeypatch.setattr(collectives, "_back_to_back", lambda pieces: sent.append(real(pieces)) or sent[-1])
    cluster = Cluster(workers)
    binding = {0: "w0", 1: "w1", 2: "w2"}
    shape = (384, 3072 if src == [Shard(1)] else 1024)  # 1.5 MiB a rank; pieces are row blocks: back to back
    got, expected, _ = redistribute(cluster, shape, (3,), binding, src, dst, seed=31, tid=(90, 91))
    check(got, expected)
    assert any(t is not None for t in sent)
    report = __import__("dtorch_protocol.messages", fromlist=["ErrorReport"]).ErrorReport(
        op="aten.mul.Tensor", src="user.py:9", message="bad", tid=92)
    poisoned = {}

    def put(self, key, value, _put=type(workers[1].store).put):
        if key[1:] == (90, 1) and not poisoned:  # the second run's shard on w1 is poisoned
            poisoned[key] = True
            value = Poison(report)
        return _put(self, key, value)

    monkeypatch.setattr(type(workers[1].store), "put", put)
    got, _, _ = redistribute(cluster, shape, (3,), binding, src, dst, seed=32, tid=(90, 93))
    assert all(isinstance(v, Poison) and v.report == report for v in got.values()), got


@pytest.mark.parametrize("op,dtype", [("sum", torch.float32), ("avg", torch.float64), ("max", torch.bfloat16),
                                      ("min", torch.int64), ("sum", torch.int32)], ids=str)
def test_a_large_all_reduce_on_two_ranks_sends_the_shards_as_they_are(workers, monkeypatch, op, dtype):
    """Rule 7 for Partial -> Replicate on two ranks (gloo): no copy of the input into a send buffer (the backend's
    own all_reduce works in place, so it needs one): each half goes to its reducer as it lies, the reduced halves
    come back into the output in place. Values equal torch's reduction of the full partial tensors in mesh order, bit
    for bit, whichever worker holds position 0, uneven halves included; a poisoned shard poisons every output."""
    from dtorch_worker import collectives

    pair, native = [], []
    made = collectives._pair_all_reduce
    monkeypatch.setattr(collectives, "_pair_all_reduce", lambda pk: pair.append(pk.template) or made(pk))
    real = collectives._native_all_reduce
    monkeypatch.setattr(collectives, "_native_all_reduce", lambda pk: native.append(pk) or real(pk))
    cluster = Cluster(workers)
    shape = (257, 1025) if dtype.itemsize >= 4 else (513, 1025)  # over 1 MiB a rank; an odd number of elements
    for k, binding in enumerate(({0: "w0", 1: "w1"}, {0: "w2", 1: "w0"})):
        got, expected, _ = redistribute(cluster, shape, (2,), binding, [Partial(op)], [Replicate()], dtype=dtype,
                                        seed=50 + k, tid=(100 + 2 * k, 101 + 2 * k))
        check(got, expected)
    assert len(pair) == 4 and not native
    stored = {(w, d): cluster.worker[w].store.get((cluster.session, 100, d)) for w, d in (("w0", 0), ("w1", 1))}
    assert {t.data_ptr() for t in pair[:2]} == {t.data_ptr() for t in stored.values()}  # the shards themselves
    report = __import__("dtorch_protocol.messages", fromlist=["ErrorReport"]).ErrorReport(
        op="aten.mul.Tensor", src="user.py:12", message="bad", tid=110)
    poisoned = []

    def put(self, key, value, _put=type(workers[1].store).put):
        if key[1:] == (110, 1) and not poisoned:
            poisoned.append(key)
            value = Poison(report)
        return _put(self, key, value)

    monkeypatch.setattr(type(workers[1].store), "put", put)
    got, _, _ = redistribute(cluster, shape, (2,), {0: "w0", 1: "w1"}, [Partial(op)], [Replicate()], dtype=dtype,
                             seed=60, tid=(110, 111))
    assert poisoned and all(isinstance(v, Poison) and v.report == report for v in got.values()), got
    assert len(pair) == 6


def test_a_collectives_outputs_are_freed_once_the_session_drops_them(workers):
    """Rule 7 keeps track of collectives sending straight from a shard until an in-place write needs them done; that
    record must not keep their outputs alive: a dropped 2 MiB output that lingers makes the next one fresh memory."""
    cluster = Cluster(workers)
    binding = {0: "w0", 1: "w1"}
    got, expected, _ = redistribute(cluster, (512, 1024), (2,), binding, [Partial()], [Replicate()], seed=61,
                                    tid=(120, 121))
    check(got, expected)
    refs = [weakref.ref(t) for t in got.values()]
    del got, expected
    for d, w in binding.items():
        cluster.worker[w].store.delete((cluster.session, 121, d))
    assert [r() is None for r in refs] == [True, True]  # at once: a worker frees by reference counts, rarely by gc


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                                   torch.bfloat16])
def test_every_dtype_sums_to_torchs_value_whether_or_not_the_backend_reduces_it(workers, dtype):
    """The backend's own all_reduce only for dtypes it reduces (gloo and NCCL have no int16: "Invalid scalar type");
    the others go through the exchange and sum here, with the same values."""
    got, expected, _ = redistribute(Cluster(workers), (5, 3), (2,), {0: "w0", 1: "w1"}, [Partial("sum")], [Replicate()],
                                    dtype=dtype)
    check(got, expected)


def test_short_forms_are_spelled_out_on_receipt():
    short = GroupOp(group="g1", generation=1, seq=1, rank=1, layout=[], devices={1: 1}, sizes=[3], src_sizes=[2],
                    ranks=3)
    full = spelled_out(short)
    assert (full.layout, full.sizes, full.src_sizes) == ([[0], [1], [2]], [3, 3, 3], [2, 2, 2])
    assert spelled_out(full) is full
    virtual = GroupOp(group="g1", generation=1, seq=1, rank=0, layout=[[0, 2], [1]], devices={0: 0, 2: 2},
                      sizes=[4, 4, 1])
    assert spelled_out(virtual) is virtual
