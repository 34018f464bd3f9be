"""Redistributions lowered to collectives (core/collectives.py): the pure lowering, and the commands the core
emits through `handle()` on a fake clock (groups, their generations and op numbers, the cost rule's fallbacks)."""

from __future__ import annotations

import pytest

from dtorch_controller.core import collectives as col
from dtorch_controller.core import events as ev
from dtorch_controller.core.redistribute import pulled
from dtorch_protocol import messages as m
from dtorch_protocol.placement_types import Partial, Replicate, Shard
from dtorch_protocol.wire import hello

P, R = Partial("sum"), Replicate()


def spec(shape, placements, mesh=1, dtype="float32"):
    return m.TensorSpec(shape=list(shape), dtype=dtype, mesh=mesh, placements=list(placements))


def redist(src, dst, src_pl, dst_pl, shape=(8, 4), mesh=1, dst_mesh=None):
    return m.InstrRedistribute(src=src, dst=dst, src_spec=spec(shape, src_pl, mesh),
                               dst_spec=spec(shape, dst_pl, dst_mesh or mesh), src_line="train.py:3")


def create(tid, placements, shape=(8, 4), mesh=1):
    return m.InstrCreate(tid=tid, spec=spec(shape, placements, mesh), init="ones")


def register(h, address, device_type="cpu", rendezvous=True, device_id=""):
    reply = h.call(ev.Register, m.RegisterWorker(
        hello=hello("worker"), address=address, device_type=device_type, memory_bytes=1 << 30,
        rendezvous=f"{address.split(':')[0]}:2900{address[-1]}" if rendezvous else "", device_id=device_id))
    return reply.worker


def setup(make_harness, n=2, types=None, rendezvous=None, devices=None, device_ids=None, **config):
    h = make_harness(**config)
    ids = [register(h, f"10.0.0.{i}:700{i}", (types or ["cpu"] * n)[i], (rendezvous or [True] * n)[i],
                    (device_ids or [""] * n)[i]) for i in range(n)]
    sid = h.open_session()
    assert h.open_mesh(sid, 1, devices or list(range(n))).placed
    return h, ids, sid


def cmds_of(sent, worker=None, kind=None):
    return [c for e in sent if worker is None or e.worker_id == worker for c in e.execute.cmds
            if kind is None or isinstance(c, kind)]


# ---------------------------------------------------------------------------- the pure lowering


@pytest.mark.parametrize("src,dst,kinds", [
    ((P,), (R,), ["all_reduce"]),
    ((Partial("max"),), (Shard(1),), ["reduce_scatter"]),
    ((Shard(0),), (R,), ["all_gather"]),
    ((Shard(0),), (Shard(1),), ["all_to_all"]),
    ((R,), (Shard(0),), ["slice"]),
    ((P, P), (R, R), ["all_reduce"]),  # one reduction over both dims: the pieces' order
    ((P, Shard(0)), (R, R), ["all_reduce", "all_gather"]),  # reduce the shard, then gather: fewer bytes
    ((Shard(0), Shard(0)), (R, R), ["all_gather", "all_gather"]),
    ((Shard(1), Shard(0)), (Shard(0), R), ["all_gather", "all_to_all"]),  # the inner dim must go first
])
def test_steps_and_their_order(src, dst, kinds):
    mesh_shape = (3,) if len(src) == 1 else (2, 2)
    steps = col.steps_for((12, 8), mesh_shape, src, dst)
    assert [s.kind for s in steps] == kinds


def test_the_nested_gather_runs_the_inner_mesh_dim_first():
    steps = col.steps_for((12, 8), (2, 2), (Shard(0), Shard(0)), (R, R))
    assert [s.mesh_dims for s in steps] == [(1,), (0,)]


@pytest.mark.parametrize("src,dst", [
    ((Shard(0), Shard(1)), (Shard(1), Shard(0))),  # no order of direct moves is valid: pieces
    ((R,), (P,)), ((Partial("sum"),), (Partial("max"),)),  # to a Partial: local, pieces do it
    ((Partial("sum"), Partial("max")), (R, R)),  # mixed reduce ops
    ((R,), (R,)),
])
def test_what_is_not_lowered(src, dst):
    mesh_shape = (2,) if len(src) == 1 else (2, 2)
    assert col.steps_for((12, 8), mesh_shape, src, dst) is None


def test_uneven_and_empty_shards_carry_their_lengths():
    (step,) = col.steps_for((2, 5), (3,), (Shard(0),), (R,))
    assert step.groups[0].sizes == (1, 1, 0) and step.groups[0].other == 5
    (step,) = col.steps_for((7, 5), (3,), (P,), (Shard(0),))
    assert step.groups[0].sizes == (3, 3, 1)


def test_ranks_are_workers_in_order_of_their_first_position_and_bytes_are_per_worker():
    low = col.lower((8,), "float32", ((0, 1, 2, 3), (4,)), (P,), (R,), ((0, "a"), (1, "b"), (2, "a"), (3, "b")),
                    (("a", "cpu", True), ("b", "cpu", True)))
    (step, (group,)) = low.steps[0]
    assert group.ranks == ("a", "b") and group.layout == ((0, 2), (1, 3))
    # all_reduce of 8 floats on 2 ranks holding 2 positions each: receive 2 x 4 (reduce-scatter) + 4 (gather)
    assert low.received == {"a": 48, "b": 48}
    # the pieces: each device pulls the 2 partial values of 8 floats that lie on the other worker
    piece = {w: n * 4 for w, n in pulled((8,), ((0, 1, 2, 3), (4,)), (P,), ((0, 1, 2, 3), (4,)), (R,),
                                         ((0, "a"), (1, "b"), (2, "a"), (3, "b"))).items()}
    assert piece == {"a": 128, "b": 128}
    assert col.cheaper(low, piece)
    assert not col.cheaper(low, {"a": 16, "b": 16})  # 48 > 2 x 16: the pieces are cheaper here


def test_a_group_that_cannot_join_or_mixes_device_types_is_not_lowered():
    args = ((8,), "float32", ((0, 1), (2,)), (P,), (R,), ((0, "a"), (1, "b")))
    assert col.lower(*args, (("a", "cpu", True), ("b", "cpu", True))) is not None
    assert col.lower(*args, (("a", "cpu", True), ("b", "cpu", False))) is None
    assert col.lower(*args, (("a", "cuda", True), ("b", "cpu", True))) is None
    # on one worker nothing moves, whatever it is
    assert col.lower((8,), "float32", ((0, 1), (2,)), (P,), (R,), ((0, "a"), (1, "a")),
                     (("a", "cpu", False),)) is not None


# ---------------------------------------------------------------------------- through handle()


def test_a_partial_to_replicate_becomes_a_group_then_numbered_ops(make_harness):
    h, ids, sid = setup(make_harness)
    h.submit(sid, 1, [create(1, ["Psum"]), redist(1, 2, ["Psum"], ["R"]), redist(1, 3, ["Psum"], ["S0"])])
    sent = h.take_sent()
    keys = {g.key for g in cmds_of(sent, None, m.CmdGroup)}
    assert len(keys) == 1 and len(keys.pop()) >= 32  # the members share the group's secret, unguessable
    for rank, w in enumerate(ids):
        group, = cmds_of(sent, w, m.CmdGroup)
        assert (group.group, group.generation, group.rank, group.store) == ("g1", 1, rank, "10.0.0.0:29000")
        assert group.members == [f"{ids[0]} at 10.0.0.0:7000", f"{ids[1]} at 10.0.0.1:7001"]
        first, second = cmds_of(sent, w, m.CmdCollective)
        assert [s.kind for s in first.steps] == ["all_reduce"] and [s.kind for s in second.steps] == ["reduce_scatter"]
        (op,) = first.steps[0].ops
        assert (op.group, op.generation, op.seq, op.rank, op.devices) == ("g1", 1, 1, rank, {rank: rank})
        assert second.steps[0].ops[0].seq == 2  # the group's next op
        assert first.in_shapes == {rank: [8, 4]} and second.out_shapes == {rank: [4, 4]}
        assert first.src_line == "train.py:3"
        kinds = [type(c).__name__ for c in cmds_of(sent, w)]
        assert kinds.index("CmdGroup") < kinds.index("CmdCollective")
    assert not cmds_of(sent, None, m.CmdRedistribute) and not cmds_of(sent, None, m.CmdExpectReads)
    h.report_all()
    h.submit(sid, 2, [redist(1, 4, ["Psum"], ["R"])])
    sent = h.take_sent()
    assert not cmds_of(sent, None, m.CmdGroup)  # the group exists: its third op
    assert {c.steps[0].ops[0].seq for c in cmds_of(sent, None, m.CmdCollective)} == {3}


def test_the_collective_path_plans_no_pieces(make_harness):
    """The pieces' plan is O(devices^2): 1,048,576 pieces for an all_gather on 1,024 devices held the core 6 s before
    the cost rule chose collectives. The rule counts what the pieces would pull without planning them."""
    from dtorch_controller.core.redistribute import plan_redistribute

    h, ids, sid = setup(make_harness, n=256)
    h.submit(sid, 1, [create(1, ["S0"], shape=(1024, 4))])
    planned = plan_redistribute.cache_info().misses
    h.submit(sid, 2, [redist(1, 2, ["S0"], ["R"], shape=(1024, 4)), redist(1, 3, ["S0"], ["S1"], shape=(1024, 4))])
    sent = h.take_sent()
    assert plan_redistribute.cache_info().misses == planned
    assert [[s.kind for c in cmds_of(sent, w, m.CmdCollective) for s in c.steps] for w in ids] == \
        [["all_gather", "all_to_all"]] * 256
    assert not cmds_of(sent, None, m.CmdRedistribute)


def test_regular_groups_travel_in_short_forms(make_harness):
    """Each rank needs its group's layout and lengths: O(ranks) per rank, 20 MB of commands for one all_gather on
    2,048 ranks. Rule 7: an empty layout where rank r hosts position r, one length where every position has it."""
    h, ids, sid = setup(make_harness, n=4)
    h.submit(sid, 1, [create(1, ["S0"]), redist(1, 2, ["S0"], ["R"]),
                      create(3, ["S0"], shape=(7, 4)), redist(3, 4, ["S0"], ["R"], shape=(7, 4))])
    even, uneven = (c.steps[0].ops[0] for c in cmds_of(h.take_sent(), ids[0], m.CmdCollective))
    assert (even.layout, even.ranks, even.sizes) == ([], 4, [2])
    assert (uneven.layout, uneven.ranks, uneven.sizes) == ([], 4, [2, 2, 2, 1])
    h, ids, sid = setup(make_harness, n=2, devices=[0, 1, 2, 3])  # virtual devices: the layout in full
    h.submit(sid, 1, [create(1, ["S0"]), redist(1, 2, ["S0"], ["R"])])
    (op,) = cmds_of(h.take_sent(), ids[0], m.CmdCollective)[0].steps[0].ops
    assert (op.layout, op.ranks, op.sizes) == ([[0, 2], [1, 3]], 0, [2])


@pytest.mark.parametrize("case", ["no rendezvous", "mixed device types", "one GPU", "cross-mesh"])
def test_fallbacks_to_point_to_point(make_harness, case):
    if case == "no rendezvous":
        h, ids, sid = setup(make_harness, rendezvous=[True, False])
    elif case == "mixed device types":
        h, ids, sid = setup(make_harness, types=["cuda", "cpu"])
    elif case == "one GPU":  # two workers on one GPU: NCCL allows one rank per device
        h, ids, sid = setup(make_harness, types=["cuda", "cuda"], device_ids=["node/GPU-1", "node/GPU-1"])
    else:
        h, ids, sid = setup(make_harness)
        assert h.open_mesh(sid, 2, [1, 0]).placed
    h.submit(sid, 1, [create(1, ["Psum"]), redist(1, 2, ["Psum"], ["R"], dst_mesh=2 if case == "cross-mesh" else None)])
    sent = h.take_sent()
    assert not cmds_of(sent, None, m.CmdCollective) and not cmds_of(sent, None, m.CmdGroup)
    assert len(cmds_of(sent, None, m.CmdRedistribute)) == 2


def test_moving_a_device_makes_a_new_generation(make_harness):
    """A migration rebinds a device: the next collective names a new group of generation 2."""
    h, ids, sid = setup(make_harness, n=3, devices=[0, 1], snapshot_every_batches=100)
    h.submit(sid, 1, [create(1, ["Psum"]), redist(1, 2, ["Psum"], ["R"])])
    first_cmds = cmds_of(h.take_sent(), None, m.CmdGroup)
    first = {g.group: g.generation for g in first_cmds}
    assert first == {"g1": 1}
    h.report_all()
    s = h.core.sessions[sid]
    spare = next(w for w in ids if w not in s.devices.values())
    h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=spare))
    h.report_all()
    h.take_sent()
    h.report_all()
    assert s.devices[1] == spare
    h.submit(sid, 2, [redist(1, 3, ["Psum"], ["R"])])
    sent = h.take_sent()
    groups = cmds_of(sent, None, m.CmdGroup)
    assert {(g.group, g.generation) for g in groups} == {("g2", 2)}
    assert len({g.key for g in groups}) == 1 and groups[0].key != first_cmds[0].key  # a new generation, a new secret
    assert {e.worker_id for e in sent if any(isinstance(c, m.CmdGroup) for c in e.execute.cmds)} == \
        {s.devices[0], spare}
    assert {c.steps[0].ops[0].seq for c in cmds_of(sent, None, m.CmdCollective)} == {1}


def test_a_lost_member_falls_back_to_the_pieces_error(make_harness):
    h, ids, sid = setup(make_harness, snapshot_every_batches=0)
    h.submit(sid, 1, [create(1, ["Psum"])])
    h.report_all()
    h.advance(0.5)
    h.report(ids[0])
    h.advance(1.0)  # ids[1] silent past the heartbeat timeout: lost, and nothing can be rebuilt
    assert h.core.workers[ids[1]].state == "lost"
    h.take_sent()
    h.submit(sid, 2, [redist(1, 2, ["Psum"], ["R"])])
    assert not cmds_of(h.take_sent(), None, m.CmdCollective)
    rid, reply = h.sync(sid, 2)
    assert any("lost" in e.message for e in reply.errors), reply


def test_a_random_op_on_a_mesh_mixing_device_types_is_one_clear_error(make_harness):
    h, ids, sid = setup(make_harness, types=["cuda", "cpu"])
    h.submit(sid, 1, [create(1, ["R"]), m.InstrCall(
        op="aten.rand_like.default", mesh=1, args=[{"$t": 1}], kwargs={},
        outs=[m.OutSpec(2, spec((8, 4), ["R"]))], src="model.py:5", seed=7)])
    rid, reply = h.sync(sid, 1)
    if reply is None:
        h.report_all()
        reply = h.replies[rid]
    (err,) = reply.errors
    assert err.src == "model.py:5" and "cpu and cuda workers" in err.message and "one device type" in err.message
