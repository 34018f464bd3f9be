"""Compatibility across releases, proven with real processes: `nox -s compat` runs this.

For each package it builds a wheel with hatch at the package's previous release tag (`<package>-v<version>`, the
newest one reachable from HEAD) and at HEAD (the working tree); a role's build is its package plus the
dtorch-protocol of the same commit. Then, for every combination of client (dtorch-api), controller and workers
(dtorch-worker) at the release or at HEAD, it starts a controller and two workers and runs a small client
program, each process importing only its own build (PYTHONPATH; the environment running this holds only the
third-party dependencies). What each combination must do is the policy of docs/architecture.md ("Versions"),
restated in `refusal` below rather than read from the code under test:

    a controller that speaks protocol X.Y serves clients of X.(Y or older) and workers of X.(Y or newer).

While the release and HEAD speak the same protocol, refusals are produced by relabelling HEAD's protocol (the
PROTOCOL_VERSION of a copy of its dtorch_protocol): a worker one minor older, a client one minor newer, a client
and a worker one major newer; a client one minor older must be served. A refused process must end with one line
naming both versions and what to upgrade.

    python integration/compat.py [--work DIR]     (needs hatch, torch and the packages' dependencies)
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path

from _helpers import start_controller, start_worker, stop_all

ROOT = Path(__file__).resolve().parents[1]
ROLES = {"client": "dtorch-api", "controller": "dtorch-controller", "worker": "dtorch-worker"}
PROTOCOL = "dtorch-protocol"
VERSION_LINE = re.compile(r'^PROTOCOL_VERSION = "(\d+)\.(\d+)"', re.M)
WAIT_S = 120.0  # bound on each process of a combination

CLIENT = """
import torch, dtorch, dtorch_protocol
from dtorch import DeviceMesh, Replicate, Shard
a = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
x = dtorch.distribute_tensor(a, DeviceMesh("cpu", [0, 1]), [Shard(0)])
y = (x @ x.T).redistribute(placements=[Replicate()])
x.add_(1)
torch.testing.assert_close(y.to_torch(), a @ a.T)
assert torch.equal(x.to_torch(), a + 1)
print("ok: dtorch", dtorch.__version__, "protocol", dtorch_protocol.PROTOCOL_VERSION)
"""


@dataclass(frozen=True)
class Build:
    """One role's package and its dtorch-protocol, unpacked, for PYTHONPATH."""

    role: str
    label: str  # the release tag, "HEAD", or "HEAD relabelled"
    version: str  # the package's own version
    protocol: tuple[int, int]
    paths: tuple[str, ...]

    def __str__(self) -> str:
        return f"{ROLES[self.role]} {self.version} [{self.label}] protocol {self.protocol[0]}.{self.protocol[1]}"


def refusal(client: Build, controller: Build, worker: Build) -> tuple[str, str] | None:
    """The policy: (who is refused, what its one line must say), or None when the combination must work."""
    major, minor = controller.protocol
    if worker.protocol[0] != major or client.protocol[0] != major:
        return ("worker" if worker.protocol[0] != major else "client"), "majors must be equal"
    if worker.protocol[1] < minor:
        return "worker", "upgrade dtorch-worker"
    if client.protocol[1] > minor:
        return "client", "upgrade dtorch-controller"
    return None


# ---------------------------------------------------------------- builds


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def previous_tag(package: str) -> str:
    tags = git("tag", "--merged", "HEAD", "--list", f"{package}-v*", "--sort=-v:refname").split()
    if not tags:
        raise SystemExit(f"compat: no release tag {package}-v* reachable from HEAD: fetch the tags (git fetch "
                         f"--tags), or tag the package's first release (git tag {package}-v<version> <commit>)")
    return tags[0]


def unpacked(package: str, ref: str | None, work: Path) -> Path:
    """`package` built by hatch at `ref` (None: the working tree) and unpacked; cached in `work`."""
    name = f"{package}@{ref or 'HEAD'}"
    dest = work / "unpacked" / name
    if dest.exists():
        return dest
    src = ROOT / "packages" / package
    if ref is not None:
        tree = subprocess.run(["git", "archive", "--format=tar", ref, f"packages/{package}"], cwd=ROOT, check=True,
                              capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tree)) as tar:
            tar.extractall(work / "src" / ref, filter="data")
        src = work / "src" / ref / "packages" / package
    wheels = work / "wheels" / name
    subprocess.run([sys.executable, "-m", "hatch", "build", "-t", "wheel", str(wheels)], cwd=src, check=True,
                   capture_output=True)
    (whl,) = wheels.glob("*.whl")
    with zipfile.ZipFile(whl) as z:
        z.extractall(dest)
    return dest


def build(role: str, ref: str | None, work: Path) -> Build:
    """`role`'s package at `ref` with the dtorch-protocol of the same commit."""
    pkg, proto = unpacked(ROLES[role], ref, work), unpacked(PROTOCOL, ref, work)
    (info,) = pkg.glob("*.dist-info")
    found = VERSION_LINE.search((proto / "dtorch_protocol" / "messages.py").read_text())
    assert found, f"no PROTOCOL_VERSION in {proto}"
    return Build(role, ref or "HEAD", info.name.removesuffix(".dist-info").rsplit("-", 1)[1],
                 (int(found.group(1)), int(found.group(2))), (str(pkg), str(proto)))


def relabel(b: Build, protocol: tuple[int, int], work: Path) -> Build:
    """`b` with a copy of its dtorch_protocol that says it speaks `protocol`."""
    dest = work / "relabelled" / f"{b.role}-{protocol[0]}.{protocol[1]}"
    if not dest.exists():
        shutil.copytree(b.paths[1], dest)
        messages = dest / "dtorch_protocol" / "messages.py"
        messages.write_text(VERSION_LINE.sub(f'PROTOCOL_VERSION = "{protocol[0]}.{protocol[1]}"',
                                             messages.read_text(), count=1))
    return replace(b, label=f"{b.label} relabelled", protocol=protocol, paths=(b.paths[0], str(dest)))


# ---------------------------------------------------------------- one combination


KEYS: dict[str, str] = {}  # "file" -> the key file, and role -> a key of it (made by HEAD's controller: `make_keys`)


def make_keys(controller: Build, work: Path) -> None:
    """A key file with a worker key and a tenant key, made with the controller's own CLI as an operator would."""
    KEYS["file"] = str(work / "keys.json")
    for role, extra in (("worker", []), ("tenant", ["--tenant", "compat"])):
        made = subprocess.run([sys.executable, "-m", "dtorch_controller", "keys", "create", "--keys", KEYS["file"],
                               "--role", role, *extra], env=env_for(controller), capture_output=True, text=True,
                              timeout=60)
        if made.returncode != 0:
            raise SystemExit(f"compat: making a {role} key failed: {made.stderr.strip()[-500:]}")
        KEYS[role] = made.stdout.strip()


def env_for(b: Build, role: str = "", **extra: str) -> dict[str, str]:
    """The environment of a process of build `b`: only its own packages, the key file, and `role`'s key."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("DTORCH_")}
    keys = {"DTORCH_KEYS": KEYS["file"], **({"DTORCH_API_KEY": KEYS[role]} if role else {})} if KEYS else {}
    return {**base, **keys, "PYTHONPATH": os.pathsep.join(b.paths), **extra}


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def check(client: Build, controller: Build, worker: Build, work: Path) -> tuple[str | None, str]:
    """Run the combination: (None when it did what the policy says, else what went wrong; the line it ended with)."""
    expected = refusal(client, controller, worker)
    logs = Path(tempfile.mkdtemp(dir=work, prefix="run-"))
    procs: list[subprocess.Popen] = []
    try:
        # a long heartbeat timeout: a loaded machine must not look like lost workers
        ctl, address = start_controller(logs / "address", env_for(controller), "--heartbeat-timeout", "30",
                                        log=logs / "controller.log", limit=WAIT_S)
        procs.append(ctl)
        workers = [start_worker(address, env_for(worker, "worker"), log=logs / f"worker{i}.log") for i in range(2)]
        procs += workers
        if expected and expected[0] == "worker":
            for i, w in enumerate(workers):
                try:
                    w.wait(WAIT_S)
                except subprocess.TimeoutExpired:
                    return f"worker {i} was not refused within {WAIT_S:g}s ({logs})", ""
                line = last_line((logs / f"worker{i}.log").read_text())
                problem = _refusal_problem(w.returncode, line, "registration refused", worker, controller, expected)
                if problem:
                    return f"worker {i}: {problem}", line
            return None, line
        out = subprocess.run([sys.executable, "-c", CLIENT], env=env_for(client, "tenant", DTORCH_CONTROLLER=address,
                                                                          DTORCH_TIMEOUT=str(WAIT_S)),
                             capture_output=True, text=True, timeout=WAIT_S + 30)
        (logs / "client.log").write_text(out.stdout + out.stderr)
        if expected is None:
            if out.returncode != 0 or not out.stdout.startswith("ok: "):
                return f"the client failed (exit {out.returncode}; {logs}): {out.stderr.strip()[-2000:]}", ""
            return None, last_line(out.stdout)
        line = last_line(out.stderr)
        return _refusal_problem(out.returncode, line, "ProtocolError", client, controller, expected), line
    finally:
        stop_all(procs)


def _refusal_problem(code: int, line: str, marker: str, who: Build, controller: Build,
                     expected: tuple[str, str]) -> str | None:
    versions = [f"{v[0]}.{v[1]}" for v in (who.protocol, controller.protocol)]
    if code == 0:
        return "exited 0 instead of being refused"
    if marker not in line or expected[1] not in line or not all(v in line for v in versions):
        return f"refused without naming {versions} and {expected[1]!r}"
    return None


# ---------------------------------------------------------------- the matrix


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", help="folder for builds and logs (default: a temporary one, removed after)")
    args = parser.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="dtorch-compat-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        releases = {role: previous_tag(ROLES[role]) for role in ROLES}
        builds = {role: [build(role, releases[role], work), build(role, None, work)] for role in ROLES}
        head = {role: bs[1] for role, bs in builds.items()}
        make_keys(head["controller"], work)
        major, minor = head["controller"].protocol
        combos = list(product(builds["client"], builds["controller"], builds["worker"])) + [
            (relabel(head["client"], (major, minor - 1), work), head["controller"], head["worker"]),
            (relabel(head["client"], (major, minor + 1), work), head["controller"], head["worker"]),
            (relabel(head["client"], (major + 1, 0), work), head["controller"], head["worker"]),
            (head["client"], head["controller"], relabel(head["worker"], (major, minor - 1), work)),
            (head["client"], head["controller"], relabel(head["worker"], (major + 1, 0), work)),
        ]
        failures = 0
        for client, controller, worker in combos:
            expected = refusal(client, controller, worker)
            problem, said = check(client, controller, worker, work)
            failures += problem is not None
            verdict = "works" if expected is None else f"{expected[0]} refused"
            print(f"{'FAIL' if problem else 'ok'}: {verdict}: client {client} | controller {controller} | workers "
                  f"{worker}\n    {problem or said}", flush=True)
        print(f"{len(combos) - failures} of {len(combos)} combinations behave as docs/architecture.md says")
        return 1 if failures else 0
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
