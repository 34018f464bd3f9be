"""The import rules of `.importlinter` (run by `nox -s lint`) hold, and each one bites: planting one import in a
copy of the sources breaks exactly the contract that forbids it. Imports inside functions count."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is not installed (nox -s tests installs it)")

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / ".importlinter"
LINT = Path(sys.executable).with_name("lint-imports")

# contract id -> (file under the packages' source roots, code appended to it) that must break that contract
PLANTED = {
    "protocol-torch-free": ("dtorch_protocol/layout.py", "import torch\n"),
    "controller-torch-free": ("dtorch_controller/core/pool.py", "def _planted():\n    import dtorch\n"),
    "controller-layers": ("dtorch_controller/core/model.py",
                          "def _planted():\n    from dtorch_controller import server\n"),
    "core-layers": ("dtorch_controller/core/pipeline.py",  # a mechanism calling back into a feature
                    "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                    "    from dtorch_controller.core import moves\n"),
    "sim-uses-core-surface": ("dtorch_sim/harness.py", "from dtorch_controller.core.scheduler import Scheduler\n"),
    # the client's stream reaching up into the session that owns it; a cycle through the rule registry
    "client-layers": ("dtorch/_stream.py", "def _planted():\n    from dtorch import session\n"),
    "client-acyclic": ("dtorch/_registry.py", "def _planted():\n    from dtorch import _rules\n"),
}


def contracts() -> list[str]:
    parser = configparser.ConfigParser()
    parser.read(CONFIG)
    return [s.split(":", 2)[2] for s in parser.sections() if s.startswith("importlinter:contract:")]


def copy_sources(dest: Path) -> Path:
    src = dest / "src"
    for root in sorted(ROOT.glob("packages/*/src")):
        shutil.copytree(root, src, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return src


def lint(src: Path, *contract: str) -> subprocess.CompletedProcess:
    args = [str(LINT), str(CONFIG), "--no-cache", "--no-logo", *(a for c in contract for a in ("--contract", c))]
    env = {**os.environ, "PYTHONPATH": str(src)}  # the copy, not the installed packages
    return subprocess.run(args, cwd=src, env=env, capture_output=True, text=True, timeout=120)


def test_every_contract_has_a_planted_import_that_breaks_it():
    assert sorted(contracts()) == sorted(PLANTED)


def test_the_sources_keep_every_contract(tmp_path):
    run = lint(copy_sources(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(PLANTED)} kept, 0 broken" in run.stdout


@pytest.mark.parametrize("contract", sorted(PLANTED))
def test_a_planted_import_breaks_its_contract(tmp_path, contract):
    src = copy_sources(tmp_path)
    path, code = PLANTED[contract]
    with open(src / path, "a") as f:
        f.write("\n\n" + code)
    run = lint(src, contract)
    assert run.returncode == 1 and "0 kept, 1 broken" in run.stdout, run.stdout + run.stderr
