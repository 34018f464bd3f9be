"""The client's import contracts (`.importlinter`: client-layers, client-acyclic) hold, and each one breaks when
an import that violates it is planted into a copy of the package (in a function or under TYPE_CHECKING too)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dtorch

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / ".importlinter"
LINT = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def lint(tmp_path: Path, contract: str, plant: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """lint-imports for one contract on a copy of the client with `plant` (file -> lines) appended."""
    copy = tmp_path / "dtorch"
    shutil.copytree(Path(dtorch.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for name, text in (plant or {}).items():
        with open(copy / name, "a") as f:
            f.write("\n" + text + "\n")
    return subprocess.run([sys.executable, "-c", LINT, str(CONFIG), "--contract", contract, "--no-cache"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("contract", ["client-layers", "client-acyclic"])
def test_the_client_keeps_its_contracts(tmp_path, contract):
    out = lint(tmp_path, contract)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 kept, 0 broken" in out.stdout


@pytest.mark.parametrize("plant", [
    {"_stream.py": "from dtorch import session"},  # the stream reaching up into its owner
    {"_relocate.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dtorch.session import Session"},
    {"_planner.py": "def f():\n    from dtorch import _dispatch"},  # a function-local import counts
    {"session.py": "from dtorch import _planner"},  # planning and the session stay independent
    {"_late.py": "X = 1"},  # a new module must be given its place in the layers
], ids=["upward", "type-checking", "in-function", "siblings", "unlisted"])
def test_the_layers_contract_breaks_on_a_planted_import(tmp_path, plant):
    out = lint(tmp_path, "client-layers", plant)
    assert out.returncode != 0 and "BROKEN" in out.stdout, out.stdout + out.stderr


def test_the_acyclic_contract_breaks_on_a_planted_cycle(tmp_path):
    out = lint(tmp_path, "client-acyclic", {"_registry.py": "def f():\n    from dtorch import _rules"})
    assert out.returncode != 0 and "BROKEN" in out.stdout, out.stdout + out.stderr
