"""Mutants that no test can kill because they do not change behaviour (equivalent mutants), with why.

Each entry: (mutated function, the mutated line as `nox -s mutation` prints it after "+") -> the reason. A
survivor whose function and mutated line match an entry is counted as equivalent, not as a survivor. Keyed by
the line, not by mutmut's mutant number, so that numbering shifts from edits elsewhere in the function do not
move an excuse onto another mutant; an entry that matches nothing any more is reported as stale.

Function names are mutmut's: `module.x_function` or `module.xǁClassǁmethod`.
"""

from __future__ import annotations

_OLDER_WINDOW = (
    "_commit drops the namespaces not in `keep`, and each of those is of an older window anyway: a snapshot "
    "namespace not committed now is an earlier one (one snapshot is taken at a time), and an upload copied in a "
    "batch sent after this snapshot started (window n) is still in rec.adopts, so in keep; those sent before are "
    "of windows below n. So `_window(ns) < window` holds for every one, and these mutants only make _window "
    "return -1 (no whitespace to split on) or the same window (session ids, made by the controller, hold no "
    "'#')"
)

EQUIVALENT: dict[tuple[str, str], str] = {
    ("dtorch_controller.core.redistribute.x__plan_one",
     'return ShardPlan(shape=out_shape, groups=plan_groups, reduce=ops[0] if ops else "SUM")'):
        "with no reduced Partial dim there is exactly one group, so the reduce op is never applied",
    ("dtorch_controller.core.redistribute.x__plan_one",
     'return ShardPlan(shape=out_shape, groups=plan_groups, reduce=ops[0] if ops else "XXsumXX")'):
        "with no reduced Partial dim there is exactly one group, so the reduce op is never applied",
    ("dtorch_controller.core.state.SESSION_TABLE", "SESSION_TABLE: without CLOSED"):
        "CLOSED has no transitions: a missing row and an empty row both raise IllegalTransition",
    ("dtorch_controller.core.state.WORKER_TABLE", "WORKER_TABLE: without LOST"):
        "LOST has no transitions: a missing row and an empty row both raise IllegalTransition",
    ("dtorch_controller.core.state.REBUILD_TABLE", "REBUILD_TABLE: without RebuildPhase.DONE"):
        "DONE has no transitions: a missing row and an empty row both raise IllegalTransition",
    ("dtorch_controller.core.state.DRAIN_TABLE", "DRAIN_TABLE: without DrainPhase.RELEASED"):
        "RELEASED has no transitions: a missing row and an empty row both raise IllegalTransition",
    ("dtorch_controller.core.state.MOVE_TABLE", "MOVE_TABLE: without MovePhase.DONE"):
        "DONE has no transitions: a missing row and an empty row both raise IllegalTransition",
    ("dtorch_controller.core.state.MOVE_TABLE", "MOVE_TABLE: without MovePhase.CALLED_OFF"):
        "CALLED_OFF has no transitions: a missing row and an empty row both raise IllegalTransition",
    ("dtorch_controller.core.state.WORKER_TABLE", "WORKER_TABLE[SUSPECT]: SILENT -> DRAINING"):
        "unreachable: the core feeds SILENT only to alive workers (controller._check_heartbeat)",
    ("dtorch_controller.core.state.WORKER_TABLE", "WORKER_TABLE[SUSPECT]: without SILENT"):
        "unreachable: the core feeds SILENT only to alive workers (controller._check_heartbeat)",
    ("dtorch_controller.core.state.WORKER_TABLE", "WORKER_TABLE[DRAINING]: SILENT -> LOST"):
        "unreachable: the core feeds SILENT only to alive workers (controller._check_heartbeat)",
    ("dtorch_controller.core.state.WORKER_TABLE", "WORKER_TABLE[DRAINING]: without SILENT"):
        "unreachable: the core feeds SILENT only to alive workers (controller._check_heartbeat)",
    ("dtorch_controller.core.state.WORKER_TABLE", "WORKER_TABLE[DRAINING]: DRAIN -> LOST"):
        "unreachable: a drain of a draining worker does not step its state (migration.py, `if w.state != DRAINING`)",
    ("dtorch_controller.core.state.WORKER_TABLE", "WORKER_TABLE[DRAINING]: without DRAIN"):
        "unreachable: a drain of a draining worker does not step its state (migration.py, `if w.state != DRAINING`)",
    ("dtorch_controller.core.state.MOVE_TABLE", "MOVE_TABLE[MovePhase.WAITING]: FAIL -> MovePhase.COPYING"):
        "only pull moves wait, and a failed one has left its session's queue (moves.py): only drain.py reads a "
        "finished move's phase, and a drain's moves are never pulls",
    ("dtorch_controller.core.scheduler.TENANT_TABLE", "TENANT_TABLE[IDLE]: CLOSE -> WAITING"):
        "Scheduler.close deletes the tenant right after this step and every other structure holds session ids: a "
        "closed tenant's state is never read",
    ("dtorch_controller.core.scheduler.TENANT_TABLE", "TENANT_TABLE[WAITING]: CLOSE -> RUNNING"):
        "Scheduler.close deletes the tenant right after this step and every other structure holds session ids: a "
        "closed tenant's state is never read",
    ("dtorch_controller.core.scheduler.TENANT_TABLE", "TENANT_TABLE[RUNNING]: CLOSE -> WAITING"):
        "Scheduler.close deletes the tenant right after this step and every other structure holds session ids: a "
        "closed tenant's state is never read",
    ("dtorch_controller.core.scheduler.TENANT_TABLE", "TENANT_TABLE[FROZEN]: CLOSE -> RUNNING"):
        "Scheduler.close deletes the tenant right after this step and every other structure holds session ids: a "
        "closed tenant's state is never read",
    ("dtorch_controller.core.pool.Slot.placeable", "placeable: bool = False"):
        "the default is never used: Slot's only constructor call (Pool.add) passes placeable",
    ("dtorch_controller.core.scheduler.xǁSchedulerǁ__init__",
     "self.moving: Callable[[str], bool] = lambda session: None"):
        "callers only test its truth (`or self.moving(h)`), and None is as false as False; the core replaces it with "
        "Moves.busy anyway",
    ("dtorch_controller.core.scheduler.xǁSchedulerǁplace", "self._pass(ch)"):
        "(the mutant of the pass in the FROZEN branch; the final pass's is killed) unreachable: `place` reaches that "
        "branch only for a frozen tenant none of whose devices is in the pool, and a frozen tenant holds only pool "
        "workers: `_lose_worker` deletes a lost worker from every frozen tenant and marks it resumable when it misses "
        "nothing more, and the same pass resumes it",
    ("dtorch_controller.core.scheduler.xǁSchedulerǁplace", "return self._finish(ch), Answer(False, 1, self._why(t))"):
        "unreachable, like the pass above it: a frozen tenant none of whose devices is in the pool resumes in the "
        "pass of the loss that took its last one",
    ("dtorch_controller.core.scheduler.xǁSchedulerǁplace", "return self._finish(ch), Answer(0, self._why(t))"):
        "unreachable, like the pass above it (the frozen-with-nothing branch)",
    ("dtorch_controller.core.scheduler.xǁSchedulerǁ_victims",
     "mine = t.key[0] if t.key is not None else self.policy.rank(None, now)"):
        "unreachable: _victims runs only from _admit of a queued request (a pass walks the queue; _fill_fragments "
        "admits without victims), whose key is set until _admit dequeues it after the victims",
    ("dtorch_controller.core.scheduler.xǁSchedulerǁadd_worker",
     "self.pool.add(w.id, node_of(w.address, w.labels), w.memory_bytes, w.order, )"):
        "a worker is added once, at its registration, when its state is always ALIVE (model.add_worker: a new "
        "Worker record), so the argument is always True, the default",
    ("dtorch_controller.core.scheduler.xǁSchedulerǁ_fill_fragments",
     "if not self.policy.packs and not self.pool.shared_room():"):
        "without packing no lease is packed, so there is no shared room and both forms return; with packing and "
        "no shared room the loop's own `and self.pool.shared_room()` ends it before its first step",
    ("dtorch_controller.core.scheduler.xǁSchedulerǁ_unwant", "wanting.pop(t.session, )"):
        "_unwant runs for a worker in t.missing, and the scheduler keeps `w in t.missing` iff `t.session in "
        "_wanted[w]` (_unreserve adds both; _offer, _unfreeze_wants and _lose_worker remove both): the key is there",
    ("dtorch_controller.core.pool.xǁPoolǁ_pick_slow", "while remaining >= 0 and free:"):
        "with nothing left to pick each further round takes `free.pop(node)[:0]`, nothing: the same workers, in the "
        "same order",
    ("dtorch_controller.core.pool.xǁPoolǁremove", "if i < len(self._ring) or self._ring[i][1] == worker:"):
        "a worker with a slot is in the ring exactly once (add inserts it, remove deletes the slot with it), so "
        "bisect finds it at i < len: both tests are true",
    ("dtorch_controller.core.policies.dtorch.xǁDTorchPolicyǁkey",
     'return (0 if t.kind == "realtime" else 1, self.score(t, None))'):
        "the scheduler asks for keys only of queued tenants (_enqueue), which do not run, and a tenant that does not "
        "run has a service that does not read `now`",
    ("dtorch_controller.core.policies.las.xǁLasPolicyǁ_promotion_at",
     "if not self.starve_factor or t.running or t.waiting_since is None or t.counted(None) <= 0:"):
        "reached only when `t.running` is false, and the service of a tenant that does not run does not read `now`",
    ("dtorch_controller.core.scheduler.xǁTenantǁheld_devices",
     "return len(self.workers) if (self.running) or True else 0"):
        "only the policies read held_devices, and each only of a running tenant: dtorch._shield_ends tests "
        "`not t.running` first, dtorch.next_change returns before it for a tenant not running, las.next_change reads "
        "it inside `if t.running`",
    ("dtorch_controller.core.scheduler.xǁSchedulerǁtick", "t.base = t.service(None)"):
        "the promotion runs only for a tenant that is not running (running ones `continue` above), and "
        "Tenant.service reads `now` only while running: the same value",
    ("dtorch_controller.core.scheduler.xǁSchedulerǁ_victims", "pending.discard(None)"):
        "a worker gone or unplaceable stays in `pending` instead of leaving it, but it can only move to `freed` "
        "through the elif branch, which it never reaches: nothing in _victims changes the pool, so it fails the "
        "same first test at every later check (a few more checks, the same victims)",
    ("dtorch_controller.core.lineage.Lineage.enabled", "enabled: bool = False"):
        "the default is never used: Lineage's only constructor call (Pipeline.rec) passes enabled",
    ("dtorch_controller.core.scheduler.TENANT_TABLE", "TENANT_TABLE: without CLOSED"):
        "CLOSED has no transitions: a missing row and an empty row both raise IllegalTransition",
    ("dtorch_controller.core.recovery.xǁRecoveryǁlost_detail",
     'why = rec.why if (rec is not None) or True else ""'):
        "rec is never None here: both callers (_report_loss, _give_up) run after unrecoverable(), whose "
        "pipeline.rec() creates the session's lineage",
    ("dtorch_controller.core.recovery.xǁRecoveryǁunrecoverable",
     "if not any(self.cluster.alive(h) for h in copies.holders.get(d, )):"):
        "an upload's copies name every device of its mesh (lineage.copy_upload; _forget_copies_on only shortens the "
        "lists) and a mesh id keeps its devices (controller._open_mesh refuses others), so the key is always there",
    ("dtorch_controller.core.recovery.xǁRecoveryǁlost_detail",
     'return ", ".join(parts) + more + (f"; not rebuilt: {why}" if why else "XXXX")'):
        "why is never empty here: both callers (_report_loss, _give_up) run after _disable(), which sets rec.why to "
        "a non-empty reason",
    ("dtorch_controller.core.moves.xǁMovesǁtarget", "skip = self.incoming() if (skip is None) and False else skip"):
        "both callers (drain.drain, Moves._start) pass skip: the default None is never used",
    ("dtorch_controller.core.moves.xǁMovesǁabort", "mv.seq, mv.started = 1, 0.0"):
        "a move's seq is read only while it copies (running, awaits, copy_failed, advance); the retried move is "
        "queued, and _start sets seq before it copies again",
    ("dtorch_controller.core.moves.xǁMovesǁabort", "self._done(step, None, mv)"):
        "_done reads the session only to settle a waiting pull or to word a successful move's reply; an aborted move "
        "was copying and has failed set, so neither happens",
    ("dtorch_controller.core.pipeline.xǁPipelineǁ_send_batch",
     "cmds, adopts, errors = self.translate(step.now, s, rec, b, replay=None)"):
        "translate reads replay only for its truth (`if replay`, `not replay`): None is False",
    ("dtorch_controller.core.snapshots.x__window", "return int(namespace.rsplit(None, 1)[1][1:])"):
        _OLDER_WINDOW,
    ("dtorch_controller.core.snapshots.x__window", 'return int(namespace.rsplit("#", )[1][1:])'):
        _OLDER_WINDOW,
    ("dtorch_controller.core.recovery.Rebuild.placed", "placed: bool = True"):
        "the default is never read: Rebuild's only constructor call (Recovery.worker_lost) is followed by _start, "
        "which sets placed = False before advance() reads it",
    ("dtorch_controller.core.recovery.xǁRecoveryǁ_needs_a_suspect",
     "needed = [rec.snapshot.holders.get(d, []) for d in _devices(s)"):
        "`needed` is the empty list just made: assigning the snapshot's holders is the same as appending them",
    ("dtorch_controller.core.recovery.xǁRecoveryǁ_reset",
     "first = rec.snapshot.first_seq if (rec.snapshot is not None) or True else {}"):
        "rec.snapshot is never None here: advance() calls _reset only after unrecoverable() returned None in the "
        "same call, which it does only for a session with a complete snapshot (and nothing between clears it)",
    ("dtorch_controller.core.recovery.xǁRecoveryǁerrors", "reset = rec.reset_seq.get(w.id, 1)"):
        "Execute seqs are ints (ErrorReport.seq: int): `0 < e.seq < 1` holds for none, as `0 < e.seq < 0`, so a "
        "worker never reset drops no report either way",
    ("dtorch_controller.core.programs.x_compile_replay",
     'bound = {s.devices.get(dev, None) for _k, mesh in meshes for dev in mesh.devices} - {""}'):
        "the default is never used: every device of a mesh in s.meshes is bound whenever a batch is translated (a "
        "mesh enters s.meshes once placed; only a rebuild's placing unbinds devices, while Hold.RECOVERING holds the "
        "batches, and a move rebinds at once), and translating an instruction on a mesh reads s.devices[d] of its "
        "devices (translate._hosts), which would have raised before",
    ("dtorch_controller.core.programs.x_compile_replay",
     'bound = {s.devices.get(dev, "XXXX") for _k, mesh in meshes for dev in mesh.devices} - {""}'):
        "the default is never used (see the entry above: every device of a translated mesh is bound)",
    ("dtorch_controller.core.programs.x_compile_replay",
     "had = dict(s.readers.get(src, {})) if (src is not None) or True else {}"):
        "`had` is read only when src is not None; with src None it is s.readers.get(None, {}), which is {} (readers "
        "are keyed by tensor ids)",
    ("dtorch_controller.core.scheduler.xǁSchedulerǁ_victims",
     "if v.state != FROZEN and len(v.missing) >= len(v.workers):"):
        "the check is a shortcut of the next one: a frozen tenant whose missing devices are all its devices holds "
        "none (held == []), and a running tenant with no workers holds none either; both are skipped by "
        "`if not held: continue`",
    ("dtorch_controller.core.lineage.x_restore_upload",
     "break  # checked before the rebuild started; a read of it will say it is missing"):
        "unreachable: Recovery.unrecoverable() gives the rebuild up before the replay when a device of a logged "
        "upload has no live copy, so copy_source never returns None during a replay",
    ("dtorch._planner.x__slot_templates", "counter = iter(range(1 << 31))"):
        "the counter numbers one op's DTensor arguments: no op has 2**30 of them",
    ("dtorch._planner.x_outs", "names = _out_names.get(None)"):
        "a cache miss every time: the names are computed again from the same schema (the same tuple, slower)",
    ("dtorch._planner.xǁPlanǁ__post_init__",
     'simple = (self.route != "XXsyncXX" and not self.inplace and not self.mutated and not self.random'):
        "a sync plan has no outputs (_planner.plan: outputs None), which `simple` refuses already",
    ("dtorch._sharding.x_check_local", "raise NoRule(None)"):
        "the message is never read: the only caller, _planner.plan, catches NoRule without it and plans the "
        "replicate route",
    ("dtorch._sharding.x_meta_outputs", "result = func(**pytree.tree_map(_to_meta, kwargs))"):
        "the call without args fails, and the fake-tensor fallback runs the same meta kernels (FakeTensorMode "
        "dispatches to them): the same specs, slower",
    ("dtorch._sharding.x__fill_partial", "return Propagation(func, args, None, None, self)"):
        "fill_.Scalar takes no keyword arguments and the plan's come from the caller's (_planner.plan); only "
        "check_local reads these, and with None it skips a check that fill_ (output = self) passes anyway",
    ("dtorch_sim.scenario.OPENB_PRIORITIES", "OPENB_PRIORITIES: without 'Burstable'"):
        "a qos class missing from the map gets priority normal (jobs.py: `prios.get(..., \"normal\")`), Burstable's",
    ("dtorch._spec.x__intern", "sid = None"):
        "the lock-free read is a shortcut: without it every key goes through the lock, where setdefault returns the "
        "id already interned (same ids, slower)",
    ("dtorch._sharding.x__fake_outputs", "mode = FakeTensorMode(allow_fallback_kernels=None)"):
        "torch reads the flag only as `if not self.allow_fallback_kernels` (fake_tensor.py): None and False are the "
        "same",
    ("dtorch_sim.scenario.xǁNodeListǁcolumn_map",
     'return {"XXnameXX": "sn", "devices": "gpu", "model": "model", **self.columns}'):
        "the name column of a node list is never read (jobs.node_groups reads devices and model; nodes are named "
        "by the simulator)",
    ("dtorch_sim.scenario.x_override",
     "raise ScenarioError([f\"--set {assignment}: the value is not valid YAML: {getattr(e, 'problem', ) or e}\"]) \\"):
        "yaml.safe_load raises only MarkedYAMLErrors, which always have `problem`: getattr without a default is the "
        "same",
}
