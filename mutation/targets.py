"""What `nox -s mutation` mutates, and with which tests. Edit this table when modules move.

TARGETS: a name -> the source files of that target, relative to the packages' `src/` folders. A file may be
a glob (`dtorch_controller/core/policies/*.py`). The kill rate is reported per target and per file.

FIRST: a target -> globs of the test files (from the repository root) that test its rules, best first. Only these
tests run: unit tests on a fake clock or in one process (the core's rules are tested through `ControllerCore.handle`
on a fake clock, `test_core_*.py`), so that the session fits in 30 minutes. Each mutant runs against up to `--cap` of
those that call the mutated function: the first glob's first, then the next glob's, ...; fastest first within each.

TESTS: the test folders the tests may come from (`--tests` picks some; they are also on `sys.path` for the helpers
beside the tests). EXCLUDE, EXCLUDE_NAMES: tests that cannot see a mutant (they start other processes, which import
the packages from the working tree, not the mutated copy) or that read the sources.
"""

from __future__ import annotations

TARGETS: dict[str, list[str]] = {
    "redistribution planner": ["dtorch_controller/core/redistribute.py"],
    "scheduler and policies": ["dtorch_controller/core/scheduler.py", "dtorch_controller/core/pool.py",
                               "dtorch_controller/core/policies/*.py"],
    "worker and session state tables": ["dtorch_controller/core/state.py"],
    "recovery and lineage": ["dtorch_controller/core/recovery.py", "dtorch_controller/core/moves.py",
                             "dtorch_controller/core/drain.py", "dtorch_controller/core/snapshots.py",
                             "dtorch_controller/core/pipeline.py", "dtorch_controller/core/lineage.py"],
    "step programs": ["dtorch_controller/core/programs.py"],
    "wire authentication and validation": ["dtorch_protocol/auth.py", "dtorch_protocol/wire.py"],
    "scenario validation": ["dtorch_sim/scenario.py"],
    "client planner": ["dtorch/_planner.py", "dtorch/_sharding.py", "dtorch/_spec.py"],
}

_CORE = "packages/dtorch-controller/tests/test_core_*.py"
FIRST: dict[str, list[str]] = {
    "redistribution planner": ["packages/dtorch-controller/tests/test_redistribute.py"],
    "scheduler and policies": ["packages/dtorch-controller/tests/test_policies.py",
                               "packages/dtorch-controller/tests/test_core_scheduling.py",
                               "packages/dtorch-controller/tests/test_core_policy_dtorch.py",
                               "packages/dtorch-controller/tests/test_core_tenants.py", _CORE],
    "worker and session state tables": ["packages/dtorch-controller/tests/test_core_workers.py",
                                        "packages/dtorch-controller/tests/test_core_sessions.py", _CORE],
    "recovery and lineage": ["packages/dtorch-controller/tests/test_core_recovery.py",
                             "packages/dtorch-controller/tests/test_core_nodes.py",
                             "packages/dtorch-controller/tests/test_core_scheduling.py", _CORE],  # relocations: pull
    "step programs": ["packages/dtorch-controller/tests/test_core_programs*.py", _CORE],  # rebuilds replay them
    "wire authentication and validation": ["packages/dtorch-protocol/tests/test_auth.py",
                                           "packages/dtorch-protocol/tests/test_wire.py",
                                           "packages/dtorch-protocol/tests/test_protocol.py",
                                           "packages/dtorch-controller/tests/test_auth.py"],
    "scenario validation": ["packages/dtorch-sim/tests/test_validation.py",
                            "packages/dtorch-sim/tests/test_scenario.py",
                            "packages/dtorch-sim/tests/test_scenario_values.py"],
    "client planner": ["packages/dtorch-api/tests/test_planner*.py", "packages/dtorch-api/tests/test_sharding.py",
                       "packages/dtorch-api/tests/test_templates.py",
                       "packages/dtorch-api/tests/test_mesh_and_specs.py", "packages/dtorch-api/tests/test_disjoint.py",
                       "packages/dtorch-api/tests/test_conformance_rules.py"],
}

# packages whose `src/` is copied into the mutation stage (everything a mutated module imports from this repo
# must be here, or the tests would import the unmutated working tree's copy)
PACKAGES = ["dtorch-protocol", "dtorch-controller", "dtorch-sim", "dtorch-api"]

TESTS = ["packages/dtorch-protocol/tests", "packages/dtorch-controller/tests", "packages/dtorch-sim/tests",
         "packages/dtorch-api/tests"]

EXCLUDE = [
    "packages/dtorch-controller/tests/test_cli.py",
    "packages/dtorch-controller/tests/test_admin_cli.py",
    "packages/dtorch-controller/tests/test_no_torch.py",
    "packages/dtorch-sim/tests/test_cli.py",
    "packages/dtorch-controller/tests/test_import_contracts.py",
]
# pytest -k (substrings of test names, so `cli` would also drop every test about a client): other subprocess tests,
# and tests that read the sources (they would read the mutated copies)
EXCLUDE_NAMES = ("not test_cli_ and not import_torch and not across_processes and not every_message_has_a_case "
                 "and not validate_warns")
