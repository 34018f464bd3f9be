"""Node-aware fault protection in the core, on a fake clock: backup copies on another node, whole-node losses,
drain targets off the drained node, and a report advancing only the sessions that wait for it."""

from __future__ import annotations

from _core_helpers import add_, create
from dtorch_controller.core import events as ev
from dtorch_controller.core.pool import Pool
from dtorch_protocol import messages as m


def cluster(make_harness, nodes=("a", "b"), per_node=3, every=2):
    """Workers of each node register one after another (as a node's agents do), nodes in turn."""
    h = make_harness(snapshot_every_batches=every)
    ids = {n: [h.register(f"10.0.{k}.{i}:7000", labels={"node": n}) for i in range(per_node)]
           for k, n in enumerate(nodes)}
    return h, ids


def node(h, worker):
    return h.core.sched.pool.slots[worker].node


def snapshot(h, sid):
    """Two batches: the snapshot after batch 2 is taken and completes."""
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    sent = h.take_sent()
    h.report_all()
    return sent


def test_backups_of_a_nodes_workers_land_on_another_node_spread_over_it(make_harness):
    h, ids = cluster(make_harness, per_node=4)
    pool = h.core.sched.pool
    for a, b in zip(ids["a"], ids["b"]):
        assert pool.backup_for(a) == b and pool.backup_for(b) == a  # worker i of A <-> worker i of B
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1, 2, 3]).placed
    s = h.core.sessions[sid]
    assert {node(h, w) for w in s.devices.values()} == {"a"}  # one node
    sent = snapshot(h, sid)
    remote = [(e.worker_id, c.to) for e in sent for c in e.execute.cmds if isinstance(c, m.CmdSendShards) and c.to]
    addresses = {h.core.workers[w].address: w for w in ids["b"]}
    assert len(remote) == 4 and all(to in addresses for _w, to in remote)
    assert len({to for _w, to in remote}) == 4  # one copy per worker of B, not all on its first one
    rec = h.core.pipeline.recs[sid]
    assert rec.snapshot.upto == 2
    assert all({node(h, x) for x in holders} == {"a", "b"} for holders in rec.snapshot.holders.values())


def test_a_whole_node_loss_is_rebuilt_from_the_copies_on_the_other_node(make_harness):
    h, ids = cluster(make_harness)
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed
    s = h.core.sessions[sid]
    assert {node(h, w) for w in s.devices.values()} == {"a"}
    snapshot(h, sid)
    h.submit(sid, 3, [add_(1)])
    h.take_sent()
    rid, reply = h.sync(sid, 3)
    assert reply is None
    for w in ids["a"]:  # the whole node goes at once
        h.handle(ev.WorkerUnreachable(w, "", "node down"))
    assert s.state == "recovering"
    for _ in range(6):
        h.take_sent()
        h.report_all()
    assert s.state == "open"
    assert {node(h, w) for w in s.devices.values()} == {"b"}
    assert h.replies[rid].done and not h.replies[rid].errors
    assert h.core.pipeline.recs[sid].recoveries == 1
    assert h.status().sessions[0].recoveries == 1


def test_a_single_node_cluster_keeps_both_copies_on_its_node_and_recovers_a_worker_loss(make_harness):
    h, ids = cluster(make_harness, nodes=("a",), per_node=3)
    a = ids["a"]
    assert [h.core.sched.pool.backup_for(w) for w in a] == [a[1], a[2], a[0]]  # the next one, as before
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed
    s = h.core.sessions[sid]
    snapshot(h, sid)
    assert h.core.pipeline.recs[sid].snapshot.upto == 2
    victim = s.devices[1]
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    for _ in range(6):
        h.take_sent()
        h.report_all()
    assert s.state == "open" and victim not in s.devices.values() and h.core.pipeline.recs[sid].recoveries == 1


def test_a_drain_moves_to_a_free_worker_of_another_node(make_harness):
    h, ids = cluster(make_harness, every=1)
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed
    s = h.core.sessions[sid]
    assert {node(h, w) for w in s.devices.values()} == {"a"}  # a2 stays free on node a
    h.submit(sid, 1, [create(1)])
    h.report_all()
    victim = s.devices[1]
    rid, reply = h.ask(ev.Drain, m.DrainRequest(worker=victim))
    assert reply is None
    for _ in range(6):
        h.report_all()
    reply = h.replies[rid]
    assert reply.ok and reply.moves[0].from_worker == victim
    assert node(h, s.devices[1]) == "b"  # not its sibling a2: the node is probably going away
    assert h.core.workers[victim].state == "lost"


def test_a_drain_on_a_single_node_moves_to_a_free_sibling(make_harness):
    h, ids = cluster(make_harness, nodes=("a",), per_node=3, every=1)
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed
    s = h.core.sessions[sid]
    h.submit(sid, 1, [create(1)])
    h.report_all()
    victim = s.devices[1]
    free = next(w for w in ids["a"] if w not in s.devices.values())
    rid, _ = h.ask(ev.Drain, m.DrainRequest(worker=victim))
    for _ in range(6):
        h.report_all()
    assert h.replies[rid].ok and s.devices[1] == free


def test_sessions_drained_off_one_worker_go_to_different_free_workers(make_harness):
    h, ids = cluster(make_harness, every=1)
    a0 = ids["a"][0]
    sids = []
    for k in range(2):  # two packed sessions share a0
        sid = h.open_session(f"s{k}", memory_cap=1 << 20)
        assert h.open_mesh(sid, 1, [0]).placed
        sids.append(sid)
    assert {h.core.sessions[sid].devices[0] for sid in sids} == {a0}
    rid, _ = h.ask(ev.Drain, m.DrainRequest(worker=a0))
    for _ in range(6):
        h.report_all()
    assert h.replies[rid].ok
    targets = [h.core.sessions[sid].devices[0] for sid in sids]
    assert len(set(targets)) == 2 and all(node(h, w) == "b" for w in targets)


def test_a_report_advances_only_the_sessions_waiting_for_it(make_harness):
    h, ids = cluster(make_harness, nodes=("a", "b", "c", "d"), per_node=2, every=2)
    idle = h.register("10.0.9.1:7000", labels={"node": "e"})
    sids = []
    for k in range(4):
        sid = h.open_session(f"s{k}")
        assert h.open_mesh(sid, 1, [0, 1]).placed
        sids.append(sid)
    for sid in sids:
        h.submit(sid, 1, [create(1)])
        h.submit(sid, 2, [add_(1)])  # every session is taking a snapshot
    h.take_sent()
    waits = h.core.waits
    assert waits.active == set(sids) and not waits.fresh  # each filed under the copies it waits for
    seen = []
    advance = h.core.snapshots.advance  # every session the settle pass looks at goes through it
    h.core.snapshots.advance = lambda step, s, rec: (seen.append(s.id), advance(step, s, rec))[1]
    h.report(idle)
    assert seen == []  # nobody waits for it
    first = h.core.sessions[sids[0]]
    h.report(first.devices[0])
    assert seen == [sids[0]]  # its snapshot waits for the other device's worker too
    h.report(first.devices[1])
    assert seen == [sids[0]] * 2
    rec = h.core.pipeline.recs[sids[0]]
    assert rec.taking is None and rec.snapshot.upto == 2 and sids[0] not in waits.active
    for w in list(h.core.workers):
        h.report(w)
    assert all(h.core.pipeline.recs[sid].snapshot.upto == 2 for sid in sids) and not waits.active


# ---------------------------------------------------------------- the pool's queries


def test_pool_backup_for_steps_over_the_node_and_skips_unplaceable_and_removed_workers():
    pool = Pool()
    order = 0
    for n in ("a", "b", "c"):
        for i in range(2):
            order += 1
            pool.add(f"{n}{i}", n, 1 << 30, order)
    assert [pool.backup_for(w) for w in ("a0", "a1", "b0", "b1", "c0", "c1")] == ["b0", "b1", "c0", "c1", "a0", "a1"]
    pool.set_placeable("b1", False)  # suspect or draining: no copies there
    assert pool.backup_for("a1") == "c0"
    pool.remove("b0")
    pool.remove("b1")
    assert pool.backup_for("a0") == "c0" and pool.backup_for("c1") == "a1"
    pool.remove("c0")
    pool.remove("c1")
    assert pool.backup_for("a0") == "a1" and pool.backup_for("a1") == "a0"  # one node left
    pool.remove("a1")
    assert pool.backup_for("a0") is None
    pool.add("a1", "a", 1 << 30, 7)
    pool.add("b0", "b", 1 << 30, 8)
    assert pool.backup_for("a0") == "b0"
    pool.set_placeable("b0", False)  # no other node takes copies now: the copy stays on the node
    assert pool.backup_for("a0") == "a1"


def test_pool_free_off_prefers_the_given_nodes_then_the_best_fit_node():
    pool = Pool()
    for k, (n, i) in enumerate([(n, i) for n, count in (("a", 2), ("b", 3), ("c", 1)) for i in range(count)]):
        pool.add(f"{n}{i}", n, 1 << 30, k)
    assert pool.free_off("a") == "c0"  # the node with the fewest free workers: whole nodes stay whole
    assert pool.free_off("a", prefer=["b"]) == "b0"
    assert pool.free_off("a", skip={"c0"}) == "b0"
    assert pool.free_on("a") == "a0" and pool.free_on("a", skip={"a0"}) == "a1"
    pool.lease("c0", "s", 0)
    assert pool.free_off("b") == "a0"


def test_a_rebuild_given_up_after_its_lost_workers_were_forgotten_points_the_devices_at_them(make_harness):
    h = make_harness(snapshot_every_batches=2, lost_workers_kept=0)
    a = [h.register(f"10.0.0.{i}:7000", labels={"node": "a"}) for i in range(2)]
    b = [h.register(f"10.0.1.{i}:7000", labels={"node": "b"}) for i in range(2)]
    sid, other = h.open_session("s"), h.open_session("t")
    assert h.open_mesh(sid, 1, [0, 1]).placed and h.open_mesh(other, 1, [0, 1]).placed
    s = h.core.sessions[sid]
    assert sorted(s.devices.values()) == a
    snapshot(h, sid)
    for w in a:  # its node goes: nowhere free to rebuild it, so it waits for the scheduler
        h.handle(ev.WorkerUnreachable(w, "", "node down"))
    h.report_all()
    assert s.state == "recovering" and not s.devices
    h.handle(ev.WorkerUnreachable(b[0], "", "killed"))  # the copy of device 0 goes; the core forgets a0 and a1
    h.report_all()
    assert s.state == "degraded" and s.devices == {0: a[0], 1: a[1]}
    assert h.core.workers[a[0]].state == "lost"
    rid, reply = h.sync(sid, 2)
    assert reply.done and "tensor 1" in reply.errors[0].message


def test_a_second_drain_does_not_send_its_moves_where_a_running_drains_move_heads(make_harness):
    """drain.py rule 1: two moves never head for the same free worker, also when they belong to two drains (the
    first's target is not leased to its session until its copy is done)."""
    h = make_harness(snapshot_every_batches=1)
    a = [h.register(f"10.0.0.{i}:7000", labels={"node": "a"}) for i in range(3)]
    b = [h.register(f"10.0.1.{i}:7000", labels={"node": "b"}) for i in range(4)]
    sids = [h.open_session(f"s{k}") for k in range(3)]
    for sid in sids:
        assert h.open_mesh(sid, 1, [0]).placed
        h.submit(sid, 1, [create(1)])
    h.report_all()
    assert sorted(h.core.sessions[sid].devices[0] for sid in sids) == a
    rids = [h.ask(ev.Drain, m.DrainRequest(worker=h.core.sessions[sid].devices[0]))[0] for sid in sids]
    copies = [c for e in h.take_sent() for c in e.execute.cmds if isinstance(c, m.CmdSendShards) and c.move]
    assert len(copies) == 3 and len({c.to for c in copies}) == 3  # all copy at once, to different workers
    for _ in range(6):
        h.report_all()
    assert all(h.replies[rid].ok for rid in rids)
    targets = [h.core.sessions[sid].devices[0] for sid in sids]
    assert len(set(targets)) == 3 and set(targets) <= set(b)


def test_a_drain_that_finds_no_worker_for_a_packed_sessions_devices_is_refused(make_harness, refused):
    """drain.py rule 1 (Moves.target): a packed session's devices go to a shared worker with room; when there is
    none (the other worker is leased whole to another session), the drain is refused in one line and nothing
    moves."""
    h = make_harness(snapshot_every_batches=1)
    w0, w1 = (h.register(f"10.0.0.{i}:7000", labels={"node": "a"}) for i in range(2))
    packed = h.open_session("packed", memory_cap=1 << 20)
    assert h.open_mesh(packed, 1, [0]).placed
    whole = h.open_session("whole")
    assert h.open_mesh(whole, 1, [0]).placed
    assert h.core.sessions[packed].devices == {0: w0} and h.core.sessions[whole].devices == {0: w1}
    reply = h.call(ev.Drain, m.DrainRequest(worker=w0))
    assert refused(reply) and reply.message == f"no other worker can take session {packed[:8]}'s devices from {w0}"
    assert h.core.workers[w0].state == "alive" and h.core.sessions[packed].devices == {0: w0}


def test_a_rebuilt_device_restores_its_shards_from_the_surviving_copy_at_its_workers_address(make_harness):
    """recovery.py rule 1: a device rebuilt on a worker that holds no copy of it fetches them from a live holder,
    by that holder's address; a device whose worker holds its own copies restores them locally."""
    h, ids = cluster(make_harness, nodes=("a",), per_node=3)
    a = ids["a"]
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed
    s = h.core.sessions[sid]
    assert s.devices == {0: a[0], 1: a[1]}  # copies: device 0 on a0 and a1, device 1 on a1 and a2
    snapshot(h, sid)
    h.handle(ev.WorkerUnreachable(a[0], "", "killed"))
    fetches = []
    for _ in range(6):
        fetches += [(e.worker_id, c) for e in h.take_sent() for c in e.execute.cmds if isinstance(c, m.CmdFetchShards)]
        h.report_all()
    assert s.state == "open" and s.devices == {0: a[2], 1: a[1]}
    assert sorted((w, c.devices, c.address) for w, c in fetches) == [
        (a[1], {1: [1]}, ""), (a[2], {0: [1]}, h.core.workers[a[1]].address)]


def test_losing_the_last_copy_while_a_rebuild_resets_its_workers_reports_the_loss(make_harness):
    """recovery.py rules 2 and 4: the only live copy of a lost device is on a worker that hosts nothing of the
    session; when that one is lost too while the rebuild resets the workers, the rebuild is given up: the session
    is degraded and its next Sync names the tensors lost and why."""
    from dtorch_controller.core import effects as fx

    h, ids = cluster(make_harness)
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed
    s = h.core.sessions[sid]
    snapshot(h, sid)
    victim = s.devices[1]
    holder = next(w for w in h.core.pipeline.recs[sid].snapshot.holders[1] if w != victim)
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    assert h.core.recovery.rebuilds[sid].phase.value == "resetting" and holder not in s.devices.values()
    h.handle(ev.WorkerUnreachable(holder, "", "killed"))  # it hosts nothing of the session
    assert s.state == "recovering"
    h.report_all()
    assert s.state == "degraded" and sid not in h.core.recovery.rebuilds
    rid, reply = h.sync(sid, 2)
    [error] = reply.errors
    assert error.kind == m.ErrorKind.WORKER_LOST
    assert error.message == (f"worker {victim} lost: unreachable: killed; 1 tensors lost: tensor 1 (made by "
                             "create:rand at train.py:3); not rebuilt: every copy of logical device 1's shards was on "
                             "lost workers")
    assert [n.why for n in h.notices if isinstance(n, fx.DataLost)] == [
        "every copy of logical device 1's shards was on lost workers"]
