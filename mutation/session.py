"""The mutation session (`nox -s mutation`): mutate the rule-bearing modules, run the unit tests, print kill rates.

Usage (from the repository root, in an environment with the packages and mutmut installed):
    python mutation/session.py [--only TARGET ...] [--max-children N] [--no-tables]

1. Stage: copy the packages' sources into `.mutation/src` and their unit tests into `.mutation/packages/*/tests`
   (the layout mutmut wants: one `src/`). In the files to mutate, decorators are lifted out of the `def` into an
   assignment after it (`f = lru_cache(f)`, `v = model_validator(mode="after")(v)`): mutmut skips decorated
   functions, which would leave every pydantic validator and cached planner function unmutated.
2. mutmut mutates function bodies (operators, constants, comparisons, arguments, return values) and runs, per
   mutant, the tests that call the mutated function (`mutation/targets.py` says which tests may).
3. Table mutants: mutmut does not touch module- or class-level data, where the rule tables live (the state
   tables, policy flags). Each entry of a dict or set literal assigned there is dropped, each dict value is
   swapped for another value of the same dict, each boolean flag is flipped; the unit tests run on each.
4. Report: per target and file the mutants, killed (a test failed or timed out), equivalent (documented in
   `mutation/equivalent.py`) and survivors with their mutated line, and the kill rate
   killed / (mutants - equivalent). Also written to `.mutation/report.json`.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from equivalent import EQUIVALENT  # noqa: E402
from targets import EXCLUDE, EXCLUDE_NAMES, FIRST, PACKAGES, TARGETS, TESTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / ".mutation"
KILLED = {1, 3, 36, -24, 24, 152, 255, -11, -9}  # mutmut exit codes: a test failed, errored, timed out or crashed
CONFTEST = '''"""Mutation stage only: every test starts with empty caches (a cached result would hide a mutant)."""
import functools
import sys

import pytest


@pytest.fixture(autouse=True)
def _fresh_caches():
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in ("dtorch", "dtorch_protocol", "dtorch_controller", "dtorch_sim"):
            for value in list(vars(module).values()):
                if isinstance(value, functools._lru_cache_wrapper):
                    value.cache_clear()
    yield
'''


@dataclass
class FileResult:
    target: str
    path: str  # relative to src/
    killed: int = 0
    equivalent: int = 0
    survivors: list[tuple[str, str]] = field(default_factory=list)  # (mutant, mutated line)

    @property
    def mutants(self) -> int:
        return self.killed + self.equivalent + len(self.survivors)

    @property
    def rate(self) -> float:
        counted = self.mutants - self.equivalent
        return 100.0 * self.killed / counted if counted else 100.0


# ---------------------------------------------------------------- staging


def files_of(targets: dict[str, list[str]], src: Path) -> dict[str, list[str]]:
    """Target -> its files (globs expanded against the staged sources), relative to src/."""
    out = {}
    for name, patterns in targets.items():
        found = sorted({str(p.relative_to(src)) for pat in patterns for p in src.glob(pat)})
        if not found:
            raise SystemExit(f"mutation: target {name!r}: no file matches {patterns} (update mutation/targets.py)")
        out[name] = found
    return out


def lift_decorators(source: str) -> str:
    """`@d1 @d2 def f` -> `def f` followed by `f = d1(d2(f))`, at every level; setters and lone static/class
    methods are left alone (mutmut handles the latter; a setter needs its property name bound)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.decorator_list:
            continue
        decos = node.decorator_list
        if any(isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter", "getter") for d in decos):
            continue
        if len(decos) == 1 and isinstance(decos[0], ast.Name) and decos[0].id in ("staticmethod", "classmethod"):
            continue
        if any(isinstance(d, ast.Name) and d.id == "overload" for d in decos):
            continue
        indent = " " * node.col_offset
        wrapped = node.name
        for d in reversed(decos):
            wrapped = f"({ast.get_source_segment(source, d)})({wrapped})"
        edits.append((node.end_lineno, f"{indent}{node.name} = {wrapped}\n", None))
        edits.append((decos[0].lineno - 1, None, node.lineno - 1))  # delete the decorator lines
    for pos, text, end in sorted(edits, key=lambda e: e[0], reverse=True):
        if text is not None:
            lines[pos:pos] = [text]
        else:
            del lines[pos:end]
    out = "".join(lines)
    ast.parse(out)
    return out


def stage(targets: dict[str, list[str]]) -> dict[str, list[str]]:
    if STAGE.exists():
        shutil.rmtree(STAGE)
    src = STAGE / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pkg in PACKAGES:
        for module in (ROOT / "packages" / pkg / "src").iterdir():
            if module.is_dir() and not module.name.endswith(".egg-info"):
                shutil.copytree(module, src / module.name, ignore=ignore)
    for tests in TESTS:
        shutil.copytree(ROOT / tests, STAGE / tests, ignore=ignore)
    shutil.copytree(ROOT / "scenarios", STAGE / "scenarios")
    (STAGE / "conftest.py").write_text(CONFTEST)
    files = files_of(targets, src)
    for path in {f for fs in files.values() for f in fs}:
        (src / path).write_text(lift_decorators((src / path).read_text()))
    folders = [t for t in TESTS if not ARGS.tests or t in ARGS.tests]
    # the unit tests of the chosen targets' rules (targets.FIRST: the core's fake-clock tests, the planners', the
    # wire's, scenario validation's), nothing that starts processes or servers for long
    chosen = dict.fromkeys(str(p.relative_to(ROOT)) for target in targets for glob in FIRST[target]
                           for p in sorted(ROOT.glob(glob)))
    tests = [t for t in chosen if t not in EXCLUDE and any(t.startswith(f + "/") for f in folders)]
    if not tests:
        raise SystemExit(f"mutation: no test of targets.FIRST for {', '.join(targets)} in {', '.join(folders)}")
    selection = [*tests, "-k", EXCLUDE_NAMES, "-m", "not gpu"]
    only = [f"src/{f}" for fs in files.values() for f in fs]
    helpers = folders  # test helpers live beside the tests (`_core_helpers`, imported by the controller's conftest)
    (STAGE / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [tool.mutmut]
        source_paths = ["src"]
        only_mutate = {json.dumps(only)}
        also_copy = ["packages", "scenarios", "conftest.py"]
        pytest_add_cli_args_test_selection = {json.dumps(selection)}
        pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "no:randomly", "-W", "ignore"]
        process_isolation = "forkserver"
        timeout_multiplier = 10.0
        timeout_constant = 5.0

        [tool.pytest.ini_options]
        addopts = "--import-mode=importlib"
        pythonpath = {json.dumps(helpers)}
        markers = ["gpu: needs a CUDA device"]
        timeout = 120
        """))
    return files


# ---------------------------------------------------------------- mutmut


def mutant_names(files: dict[str, list[str]]) -> dict[str, list[str]]:
    """Target -> the names of its mutmut mutants (as mutmut will generate them from the staged sources)."""
    os.chdir(STAGE)  # mutmut reads its configuration from the current folder
    from mutmut.mutation.file_mutation import mutate_file_contents

    out = {}
    for target, paths in files.items():
        out[target] = [f"{path.removesuffix('.py').replace('/', '.').removesuffix('.__init__')}.{name}"
                       for path in paths
                       for name in mutate_file_contents(f"src/{path}", (STAGE / "src" / path).read_text()).mutant_names]
    os.chdir(ROOT)
    return out


def sample(names: list[str], n: int) -> list[str]:
    """A fixed sample of n names (all when n is 0 or there are fewer), spread over the whole list."""
    if not n or len(names) <= n:
        return list(names)
    return sorted(random.Random(0).sample(sorted(names), n))


def run_mutmut(names: list[str], max_children: int, cap: int, budget: float) -> None:
    """Run the named mutants. The first one alone collects the per-test coverage; then each function keeps at most
    `cap` of its covering tests (0: all) that took at most `budget` seconds together, in the order of `_prefer` (the
    target's own test files first: targets.FIRST), so that a survivor costs seconds, not every test of the core."""
    mutmut = [str(Path(sys.executable).parent / "mutmut"), "run", "--max-children", str(max_children)]
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    stats_path, config = STAGE / "mutants" / "mutmut-stats.json", STAGE / "pyproject.toml"
    quiet = config.read_text()
    for batch in ([names[0]], names[1:]) if cap else (names,):
        for attempt in (1, 2):  # a test that failed once under load gets one more chance, with its output shown
            if batch:
                code = subprocess.run([*mutmut, *batch], cwd=STAGE, env=env).returncode
                if code not in (0, 1):  # mutmut exits 1 when mutants survived (and when it collected no coverage)
                    raise SystemExit(f"mutation: mutmut failed (exit code {code}); see its output above")
            if stats_path.exists():
                break
            if attempt == 2:
                raise SystemExit("mutation: mutmut collected no coverage: a test fails on the unmutated stage (its "
                                 "output is above)")
            print("mutation: a test failed while mutmut collected coverage; once more, showing pytest's output",
                  flush=True)
            config.write_text(quiet.replace("[tool.mutmut]\n", "[tool.mutmut]\ndebug = true\n", 1))
        if config.read_text() != quiet:
            config.write_text(quiet)
        if cap:
            stats = json.loads(stats_path.read_text())
            durations = stats["duration_by_test"]
            stats["tests_by_mangled_function_name"] = {
                fn: _within(_prefer(fn, tests, durations), durations, cap, budget)
                for fn, tests in stats["tests_by_mangled_function_name"].items()}
            stats_path.write_text(json.dumps(stats))


def _within(tests: list[str], durations: dict[str, float], cap: int, budget: float) -> list[str]:
    """The first of `tests` up to `cap` of them, skipping those that would take the total past `budget` seconds
    (the first is always kept): a function called by many fast tests keeps many, one called by slow tests few."""
    kept: list[str] = []
    spent = 0.0
    for t in tests:
        if len(kept) >= cap:
            break
        took = durations.get(t, 0.0)
        if kept and spent + took > budget:
            continue
        kept.append(t)
        spent += took
    return kept


def _prefer(function: str, tests: list[str], durations: dict[str, float]) -> list[str]:
    """The tests that call `function`, best first: by `_order`'s group, then one case of each test function before
    a second case of any (a parametrized plan checker has hundreds of fast cases: the cap must not keep only the
    fastest few of one of them), then fastest first."""
    group = {t: _order(function, t, durations)[0] for t in tests}
    ordered = sorted(tests, key=lambda t: (group[t], durations.get(t, 0.0)))
    seen: dict[tuple[int, str], int] = {}
    nth = {}
    for t in ordered:  # the how-manieth case of its test function
        key = (group[t], t.partition("[")[0])
        nth[t] = seen[key] = seen.get(key, -1) + 1
    return sorted(ordered, key=lambda t: (group[t], nth[t], durations.get(t, 0.0)))


def _order(function: str, test: str, durations: dict[str, float]) -> tuple[int, float]:
    """Where `test` goes among the tests that call `function` (mutmut's name: `package.module.x_name`): the test
    file named for the module first, then the target's FIRST globs in their order, then the module's own package's
    tests, then any other; fastest first."""
    module = function.split(".x")[0]
    globs = FIRST.get(MODULE_TARGET.get(module, ""), [])
    file = test.partition("::")[0]
    name = module.rpartition(".")[2].lstrip("_")
    if file.rpartition("/")[2].startswith((f"test_{name}", f"test_core_{name}")):
        return -1, durations.get(test, 0.0)  # the test file named for the module (test_wire.py for wire.py)
    group = next((i for i, glob in enumerate(globs) if fnmatch(file, glob)), None)
    if group is None:
        group = len(globs) + (0 if file.startswith(f"packages/{_package_of(module.replace('.', '/'))}/tests/") else 1)
    return group, durations.get(test, 0.0)


def mutmut_results(files: dict[str, list[str]]) -> dict[str, FileResult]:
    os.chdir(STAGE)
    sys.path.insert(0, str(STAGE / "mutants" / "src"))
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    results = {}
    for target, paths in files.items():
        for path in paths:
            res = results[path] = FileResult(target, path)
            meta = STAGE / "mutants" / "src" / f"{path}.meta"
            codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
            for name, code in sorted(codes.items()):
                if name not in CHOSEN:
                    continue
                if code in KILLED:
                    res.killed += 1
                    continue
                diff = get_diff_for_mutant(name, path=f"src/{path}")
                line = next((ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and
                             not ln.startswith("+++")), "?")
                note = "" if code == 0 else f" [{'no tests' if code in (5, 33) else f'exit {code}'}]"
                _record(res, name.rpartition("__mutmut_")[0], name + note, line)
    os.chdir(ROOT)
    return results


def _record(res: FileResult, function: str, name: str, line: str) -> None:
    if (function, line) in EQUIVALENT:
        res.equivalent += 1
        USED.add((function, line))
    else:
        res.survivors.append((name, line))


USED: set[tuple[str, str]] = set()
PHASES: dict[str, float] = {}  # seconds of each phase: stage (and mutant generation), mutmut, tables
MODULE_TARGET: dict[str, str] = {}  # dotted module name -> its target (for the order of its tests)
CHOSEN: set[str] = set()  # the mutmut mutants of this run (a sample unless --full)


# ---------------------------------------------------------------- table mutants


def _simple(node: ast.AST) -> bool:
    return isinstance(node, (ast.Constant, ast.Name, ast.Attribute))


def table_mutants(source: str) -> list[tuple[str, str, str]]:
    """(where, mutated line, mutated source) for every table entry and flag at module or class level."""
    tree = ast.parse(source)
    out = []

    def scopes(body, owner):
        for stmt in body:
            if isinstance(stmt, ast.ClassDef):
                yield from scopes(stmt.body, f"{owner}{stmt.name}.")
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
                if isinstance(target, ast.Name):
                    yield f"{owner}{target.id}", stmt

    for where, stmt in scopes(tree.body, ""):
        for variant, label in _variants(stmt):
            mutated = ast.unparse(variant)
            indent = " " * stmt.col_offset
            lines = source.splitlines(keepends=True)
            lines[stmt.lineno - 1:stmt.end_lineno] = [indent + mutated + "\n"]
            out.append((where, label, "".join(lines)))
    return out


def _variants(stmt: ast.stmt):
    """Copies of `stmt` with one entry of a table dropped or changed, or its flag flipped."""
    value = stmt.value
    if isinstance(value, ast.Constant) and isinstance(value.value, bool):
        v = copy.deepcopy(stmt)
        v.value.value = not value.value
        yield v, f"{ast.unparse(v)}"
        return
    paths = []  # paths (lists of child indices) to dict/set displays inside the value

    def walk(node, path):
        if isinstance(node, ast.Dict) and all(k is None or _simple(k) for k in node.keys):
            paths.append(path)
            for i, child in enumerate(node.values):
                walk(child, path + [i])
        elif isinstance(node, ast.Set) and all(_simple(e) for e in node.elts):
            paths.append(path)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "frozenset" \
                and node.args:
            walk(node.args[0], path + ["arg"])

    def at(root, path):
        node = root.value
        for step in path:
            node = node.args[0] if step == "arg" else node.values[step]
        return node

    walk(value, [])
    for path in paths:
        node = at(stmt, path)
        where = _label(stmt) + "".join(f"[{ast.unparse(_key_at(stmt, path[:i + 1]))}]"
                                       for i in range(len(path)) if path[i] != "arg")
        if isinstance(node, ast.Set):
            for i in range(len(node.elts)):
                v = copy.deepcopy(stmt)
                gone = at(v, path).elts.pop(i)
                if at(v, path).elts:
                    yield v, f"{where}: without {ast.unparse(gone)}"
            continue
        entries = [i for i, k in enumerate(node.keys) if k is not None]
        options = {ast.unparse(val): val for i, val in enumerate(node.values) if i in entries and _simple(val)}
        for i in entries:
            key = ast.unparse(node.keys[i])
            v = copy.deepcopy(stmt)
            d = at(v, path)
            del d.keys[i], d.values[i]
            yield v, f"{where}: without {key}"
            mine = ast.unparse(node.values[i])
            others = [text for text in options if text != mine]
            if _simple(node.values[i]) and others:  # the next other value of the table, in its order
                text = next((t for t in others if list(options).index(t) > list(options).index(mine)), others[0]) \
                    if mine in options else others[0]
                v = copy.deepcopy(stmt)
                at(v, path).values[i] = copy.deepcopy(options[text])
                yield v, f"{where}: {key} -> {text}"


def _key_at(stmt: ast.stmt, path: list) -> ast.AST:
    """The key under which the display at `path` sits in its parent dict."""
    node = stmt.value
    for step in path[:-1]:
        node = node.args[0] if step == "arg" else node.values[step]
    return node.keys[path[-1]]


def _label(stmt: ast.stmt) -> str:
    target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
    return ast.unparse(target)


def run_tables(files: dict[str, list[str]], results: dict[str, FileResult], workers: int, per_target: int) -> None:
    stats = json.loads((STAGE / "mutants" / "mutmut-stats.json").read_text())
    durations = stats.get("duration_by_test", {})
    covering = stats.get("tests_by_mangled_function_name", {})
    jobs = []
    for paths in files.values():
        mine = []
        for path in paths:
            module = path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
            source = (ROOT / "packages" / _package_of(path) / "src" / path).read_text()
            # the tests that call into the module, then the rest of its package's tests; within each, `_prefer`'s
            # order (the target's own test files first, one case of each test function before a second case of any,
            # fastest first), so the budget does not end inside the first file
            first = {t for fn, tests in covering.items() if fn.startswith(module + ".") for t in tests}
            own = f"packages/{_package_of(path)}/tests/"
            order = (_prefer(f"{module}.x", [t for t in durations if t in first], durations)
                     + _prefer(f"{module}.x", [t for t in durations if t not in first and t.startswith(own)],
                               durations))
            if per_target:  # a sample: each table mutant gets the --cap/--budget share of tests a function gets
                order = _within(order, durations, ARGS.cap, ARGS.budget)
            for where, label, mutated in table_mutants(source):
                mine.append((path, module, where, label, mutated, order))
        jobs += [mine[i] for i in sample(list(range(len(mine))), per_target)] if per_target else mine
    # a documented equivalent would be counted as equivalent whatever its tests do: it is not run (as a survivor,
    # it would run every test it was given, the slowest table mutants of all)
    known = [job for job in jobs if (f"{job[1]}.{job[2]}", job[3]) in EQUIVALENT]
    for path, module, where, label, _, _ in known:
        _record(results[path], f"{module}.{where}", f"{module}.{where} (table)", label)
    jobs = [job for job in jobs if job not in known]
    if not jobs:
        return
    print(f"mutation: {len(jobs)} table mutants ({len(known)} more documented as equivalent, not run)", flush=True)
    slots = [STAGE / "tables" / str(i) for i in range(workers)]
    for slot in slots:
        shutil.copytree(STAGE / "mutants", slot, ignore=shutil.ignore_patterns("*.meta", "mutmut-*"))
        shutil.rmtree(slot / "src")
        shutil.copytree(STAGE / "src", slot / "src")
    free = list(slots)

    def one(job):
        path, module, where, label, mutated, order = job
        slot = free.pop()
        try:
            target = slot / "src" / path
            original = target.read_text()
            target.write_text(mutated)
            try:
                env = {**os.environ, "PYTHONPATH": str(slot / "src"), "OMP_NUM_THREADS": "1"}
                proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                       "-p", "no:randomly", "-W", "ignore", "--rootdir", str(slot), *order],
                                      cwd=slot, env=env, capture_output=True, timeout=600)
                return job, proc.returncode
            except subprocess.TimeoutExpired:
                return job, 124
            finally:
                target.write_text(original)
        finally:
            free.append(slot)

    with ThreadPoolExecutor(workers) as pool:
        for (path, module, where, label, _, _), code in pool.map(one, jobs):
            res = results[path]
            if code not in (0, 5):
                res.killed += 1
            else:
                _record(res, f"{module}.{where}", f"{module}.{where} (table)", label)


def _package_of(path: str) -> str:
    top = path.split("/")[0]
    for pkg in PACKAGES:
        if (ROOT / "packages" / pkg / "src" / top).is_dir():
            return pkg
    raise SystemExit(f"mutation: no package holds {path}")


# ---------------------------------------------------------------- report


def report(files: dict[str, list[str]], results: dict[str, FileResult], seconds: float) -> dict:
    rows = []
    print(f"\n{'target / file':58} {'mutants':>8} {'killed':>7} {'equiv':>6} {'survived':>9} {'killed %':>9}")
    for target, paths in files.items():
        total = FileResult(target, "")
        for path in paths:
            r = results[path]
            total.killed += r.killed
            total.equivalent += r.equivalent
            total.survivors += r.survivors
        print(f"{target:58} {total.mutants:8} {total.killed:7} {total.equivalent:6} {len(total.survivors):9} "
              f"{total.rate:8.1f}%")
        for path in paths:
            r = results[path]
            print(f"  {path:56} {r.mutants:8} {r.killed:7} {r.equivalent:6} {len(r.survivors):9} {r.rate:8.1f}%")
        rows.append({"target": target, "mutants": total.mutants, "killed": total.killed,
                     "equivalent": total.equivalent, "survived": len(total.survivors),
                     "kill_rate": round(total.rate, 1),
                     "files": {p: {"mutants": results[p].mutants, "killed": results[p].killed,
                                   "equivalent": results[p].equivalent, "kill_rate": round(results[p].rate, 1),
                                   "survivors": results[p].survivors} for p in paths}})
    print("\nsurvivors (mutant: the mutated line; `mutmut show NAME` in .mutation for the whole diff):")
    for r in results.values():
        for name, line in r.survivors:
            print(f"  {name}: {line}")
    stale = sorted(set(EQUIVALENT) - USED)
    if stale and not ARGS.only and ARGS.full and not ARGS.no_tables:  # a sample or no tables misses survivors
        print("\nstale entries in mutation/equivalent.py (no survivor matches them any more):")
        for function, line in stale:
            print(f"  {function}: {line}")
    below = [row["target"] for row in rows if row["kill_rate"] < 90.0]
    phases = ", ".join(f"{name} {s / 60:.1f}" for name, s in PHASES.items())
    print(f"\nmutation: {seconds / 60:.1f} min ({phases}); " +
          (f"below the 90% target: {', '.join(below)}" if below else "every target at or above 90% killed"))
    out = {"seconds": round(seconds), "phases": {k: round(v) for k, v in PHASES.items()}, "targets": rows}
    (STAGE / "report.json").write_text(json.dumps(out, indent=1))
    return out


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], metavar="TARGET",
                        help=f"only these targets (repeatable): {', '.join(TARGETS)}")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--no-tables", action="store_true", help="skip the table mutants")
    parser.add_argument("--sample", type=int, default=60, metavar="N",
                        help="mutmut mutants per target (a fixed sample; a third as many table mutants); default 60")
    parser.add_argument("--cap", type=int, default=100, metavar="K",
                        help="run each mutant against at most K of the tests that call its function (the target's own "
                             "test files first: targets.FIRST; one case of each test function first); default 100")
    parser.add_argument("--budget", type=float, default=2.0, metavar="S",
                        help="... that took at most S seconds together when mutmut timed them; default 2")
    parser.add_argument("--full", action="store_true", help="every mutant against every covering test (hours)")
    parser.add_argument("--tests", action="append", default=[], metavar="FOLDER", choices=TESTS,
                        help="only these test folders may kill mutants (repeatable; default: all of targets.TESTS)")
    ARGS = parser.parse_args()
    unknown = [t for t in ARGS.only if t not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    targets = {k: v for k, v in TARGETS.items() if not ARGS.only or k in ARGS.only}
    start = time.monotonic()
    files = stage(targets)
    MODULE_TARGET.update({path.removesuffix(".py").replace("/", ".").removesuffix(".__init__"): target
                          for target, paths in files.items() for path in paths})
    names = mutant_names(files)
    per_target = 0 if ARGS.full else ARGS.sample
    chosen = [n for target in targets for n in sample(names[target], per_target)]
    CHOSEN.update(chosen)
    print(f"mutation: {len(chosen)} of {sum(map(len, names.values()))} mutmut mutants"
          + ("" if ARGS.full else f" (a fixed sample of up to {per_target} per target; --full for all)"), flush=True)
    PHASES["stage"] = time.monotonic() - start
    run_mutmut(chosen, ARGS.max_children, 0 if ARGS.full else ARGS.cap, ARGS.budget)
    results = mutmut_results(files)
    PHASES["mutmut"] = time.monotonic() - start - PHASES["stage"]
    if not ARGS.no_tables:
        run_tables(files, results, ARGS.max_children, 0 if ARGS.full else ARGS.sample // 3)
    PHASES["tables"] = time.monotonic() - start - PHASES["stage"] - PHASES["mutmut"]
    report(files, results, time.monotonic() - start)


ARGS = argparse.Namespace(only=[], tests=[], full=False, no_tables=False)

if __name__ == "__main__":
    main()
