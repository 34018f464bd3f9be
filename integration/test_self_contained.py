"""A fresh clone works alone: nothing shipped refers to a path outside the repository.

The shipped scenarios once pointed at a traces folder two levels up, which existed only beside the repository
on the machines it was built on. Scenarios are checked by loading them (every file they read lies inside the
repository and exists); every other file a user or CI reads (tests, examples, benchmarks, docs and their
commands, scenarios, nox and CI scripts) is scanned for paths that leave it. `.ci/run` proves the same by
running the suite in a fresh clone with nothing beside it.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import pytest

from dtorch_sim.scenario import load

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "scenarios" / "traces"
TEXT = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini", ".json"}
SCRIPTS = {".ci/run"}  # extensionless text files that are read too

# (what, pattern): each match is one path reference to judge
UP = re.compile(r"(?<![\w/.~-])(?:\.\./)+[^\s`'\")\]>,;]*")  # ../x, ../../traces/a.csv
ABSOLUTE = re.compile(r"(?<![\w/.:@~-])/(?:work|home|root|Users|mnt|shared|scratch|data|srv|opt)/[\w./-]+")
HOME = re.compile(r"(?<![\w/.-])~/[\w./-]+")
FILE_PARENTS = re.compile(r"__file__\)(?:\.resolve\(\)|\.absolute\(\))?(?:\.parents\[(\d+)\]|((?:\.parent)+))")


def shipped_files() -> list[Path]:
    """The repository's files as git sees them (tracked, and new ones not ignored), text only."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    names = sorted({n for n in out.split("\0") if n})
    here = Path(__file__).resolve().relative_to(ROOT).as_posix()
    return [ROOT / n for n in names if n != here and (Path(n).suffix in TEXT or n in SCRIPTS)
            and (ROOT / n).is_file()]


def inside(path: Path) -> bool:
    """Whether `path` lies in the repository (a relative reference counts when it names a file there, read from
    the referring file's folder, as links are, or from the root, as commands are)."""
    return path.resolve().is_relative_to(ROOT)


def outside_references(name: str, text: str) -> list[str]:
    """'line: reference' for every path in `text` (file `name`, relative to the root) that leaves the repository."""
    problems = []
    path = ROOT / name
    depth = len(Path(name).parts) - 1  # folders between the repository root and the file
    for n, line in enumerate(text.splitlines(), 1):
        for m in UP.finditer(line):
            ref = m.group(0).rstrip(".:")
            if not any(inside(base / ref) and (base / ref).exists() for base in (path.parent, ROOT)):
                problems.append(f"{n}: {ref}")
        problems += [f"{n}: {m.group(0)}" for pattern in (ABSOLUTE, HOME) for m in pattern.finditer(line)]
        if path.suffix == ".py":
            for m in FILE_PARENTS.finditer(line):
                up = int(m.group(1)) if m.group(1) is not None else m.group(2).count(".parent") - 1
                if up > depth:  # parents[depth] is the repository root
                    problems.append(f"{n}: {m.group(0)} (above the repository root)")
    return problems


def test_no_shipped_file_refers_to_a_path_outside_the_repository():
    files = shipped_files()
    assert any(f.suffix == ".yaml" for f in files) and any(f.name == "README.md" for f in files)
    found = {name: p for f in files
             if (p := outside_references(name := f.relative_to(ROOT).as_posix(), f.read_text(errors="replace")))}
    assert found == {}, "paths outside the repository (a fresh clone has nothing beside it):\n" + "\n".join(
        f"  {name}:{p}" for name, problems in found.items() for p in problems)


# The bad samples name a folder beside the repository; built here, so that this file itself names none.
BESIDE = "shared"


@pytest.mark.parametrize("name, text, bad", [
    ("scenarios/x.yaml", f"    path: ../../{BESIDE}/traces/msft-itp-cluster04.csv", True),
    ("docs/x.md", f"This page grows from `../{BESIDE}/DESIGN.md` (the map)", True),
    ("README.md", f"python3 /work/{BESIDE}/tools/run.py", True),
    ("docs/x.md", "cp ~/traces/x.csv .", True),
    ("integration/x.py", "REPO = Path(__file__).resolve().parents[2]", True),
    ("packages/dtorch-sim/tests/x.py", "ROOT = Path(__file__).parent.parent.parent.parent.parent", True),
    ("packages/dtorch-sim/README.md", "[docs/simulation.md](../../docs/simulation.md)", False),
    ("packages/dtorch-sim/tests/x.py", "REPO = Path(__file__).resolve().parents[3]", False),
    ("integration/x.py", "ROOT = Path(__file__).parent.parent", False),
    ("docs/x.md", "dtorch-sim compare scenarios/openb.yaml --out /tmp/openb", False),
    (".ci/run", "#!/usr/bin/env bash", False),
])
def test_the_scan_catches_what_left_the_repository(name, text, bad):
    assert bool(outside_references(name, text)) == bad


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "scenarios").glob("*.yaml")))
def test_shipped_scenarios_read_only_files_inside_the_repository(name):
    sc = load(ROOT / "scenarios" / name)
    paths = [sc.trace_path()] if sc.workload.trace is not None else []
    if sc.cluster.node_list is not None:
        paths.append(sc.resolve(sc.cluster.node_list.path))
    for p in paths:
        assert inside(p) and p.is_file(), f"{name} reads {p}, which is not a file inside {ROOT}"


def test_traces_are_the_published_bytes():
    """scenarios/traces/SHA256SUMS holds the digests of the files as published (see the README there)."""
    sums = dict(reversed(line.split()) for line in (TRACES / "SHA256SUMS").read_text().splitlines() if line)
    assert sorted(sums) == sorted(p.name for p in TRACES.iterdir() if p.suffix in (".csv", ".txt"))
    for name, digest in sums.items():
        assert hashlib.sha256((TRACES / name).read_bytes()).hexdigest() == digest, f"{name} was changed"
