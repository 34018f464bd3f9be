"""Mutants that no test can kill because they do not change behaviour (equivalent mutants), with why.

Each entry: (mutated function, the mutated line as `nox -s mutation` prints it after "+") -> the reason. A
survivor whose function and mutated line match an entry is counted as equivalent, not as a survivor. Keyed by
the line, not by mutmut's mutant number, so that numbering shifts from edits elsewhere in the function do not
move an excuse onto another mutant; an entry that matches nothing any more is reported as stale.

Function names are mutmut's: `module.x_function` or `module.xǁClassǁmethod`.
"""

from __future__ import annotations

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
    ("dtorch_controller.core.scheduler.TENANT_TABLE", "TENANT_TABLE: without CLOSED"):
        "CLOSED has no transitions: a missing row and an empty row both raise IllegalTransition",
    ("dtorch_controller.core.recovery.xǁRecoveryǁlost_detail",
     'why = rec.why if (rec is not None) or True else ""'):
        "rec is never None here: both callers (_report_loss, _give_up) run after unrecoverable(), whose "
        "pipeline.rec() creates the session's lineage",
    ("dtorch_controller.core.scheduler.xǁSchedulerǁ_victims",
     "if v.state != FROZEN and len(v.missing) >= len(v.workers):"):
        "the check is a shortcut of the next one: a frozen tenant whose missing devices are all its devices holds "
        "none (held == []), and a running tenant with no workers holds none either; both are skipped by "
        "`if not held: continue`",
    ("dtorch_controller.core.lineage.x_restore_upload",
     "break  # checked before the rebuild started; a read of it will say it is missing"):
        "unreachable: Recovery.unrecoverable() gives the rebuild up before the replay when a device of a logged "
        "upload has no live copy, so copy_source never returns None during a replay",
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
