"""The simulator watches the core only through its observer surface: `handle`, the notices among the effects and
the read-only `view` (docs/architecture.md). No reads of the core's records, no patched methods."""

from __future__ import annotations

import ast
from pathlib import Path

import dtorch_sim

ALLOWED = {"handle", "view"}  # ControllerCore's observer surface


def test_the_simulator_uses_only_the_cores_observer_surface():
    uses = []
    for path in sorted(Path(dtorch_sim.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            # self.core.<name> or sim.core.<name>: what the simulator reads of the ControllerCore it drives
            inner = node.value if isinstance(node, ast.Attribute) else None
            if isinstance(inner, ast.Attribute) and inner.attr == "core" and isinstance(inner.value, ast.Name) \
                    and inner.value.id in ("self", "sim"):
                uses.append((path.name, node.lineno, node.attr))
            patching = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in {"setattr", "getattr"}
            if patching:
                target = node.args[0] if node.args else None
                assert not (isinstance(target, ast.Attribute) and target.attr in ("core", "sched")), \
                    f"{path.name}:{node.lineno}: {node.func.id} on the core"
    assert uses and {attr for _f, _line, attr in uses} <= ALLOWED, [u for u in uses if u[2] not in ALLOWED]
