"""Every job of the DTorch monorepo. `nox -s tests` is what CI runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

PACKAGES = [
    "packages/dtorch-protocol",
    "packages/dtorch-api",
    "packages/dtorch-controller",
    "packages/dtorch-worker",
    "packages/dtorch-sim",
]
TORCH = "torch==2.13.0"  # the packages accept >=2.13,<2.15; we test on 2.13 (private sharding APIs move)
TEST_DEPS = ["pytest>=8", "pytest-timeout", "pytest-randomly", "pytest-xdist", "numpy", "expecttest", "transformers",
             "diffusers", "import-linter", "kubernetes-validate", "pyyaml", "cryptography", "hatchling",
             "tomli; python_version < '3.11'"]  # hatchling: test_packaging builds wheels offline


def third_party_dependencies() -> list[str]:
    """Every package's install dependencies that are not DTorch packages themselves."""
    deps = {d for p in PACKAGES for d in nox.project.load_toml(f"{p}/pyproject.toml")["project"]["dependencies"]}
    return sorted(d for d in deps if not d.startswith("dtorch-"))


def install(session: nox.Session, *extra: str) -> None:
    session.install(TORCH)
    session.install(*[arg for p in PACKAGES for arg in ("-e", p)], *extra)


def install_prometheus(session: nox.Session) -> None:
    """The Debian `prometheus` package where it can be installed (root with apt-get; bounded), for the test that has a
    real Prometheus scrape the cluster; where it cannot, that test skips with one line."""
    if shutil.which("prometheus") is None and shutil.which("apt-get") and os.geteuid() == 0:
        session.run("timeout", "300", "sh", "-c", "apt-get update -qq && apt-get install -y -qq prometheus",
                    external=True, success_codes=[0, 100, 124])


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite: unit tests of each package and integration tests with real processes (a real Prometheus
    among them where it can be installed), in two test processes (pytest-xdist; `-- -n 0` runs them in one): most of
    the suite's time is real processes starting and waiting, which two at a time overlap (on a 2-core machine, 14
    minutes instead of 18)."""
    install(session, *TEST_DEPS)
    install_prometheus(session)
    session.run("pytest", "-q", "-m", "not gpu", "-n", "2", *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """100,000 malformed and hostile messages to every RPC of both services of real processes: counts per RPC,
    refusals, unhandled exceptions, RSS before and after, then a real computation compared with torch."""
    install(session, *TEST_DEPS)
    session.run("python", "integration/_fuzz.py", "--messages", "100000", *session.posargs)


@nox.session
def observability(session: nox.Session) -> None:
    """Metrics scraped by a real Prometheus and usage records (integration/test_observability.py). Installs the
    Debian `prometheus` package where it can (root with apt-get); where it cannot, the test skips with one line."""
    install(session, *TEST_DEPS)
    install_prometheus(session)
    session.run("pytest", "-q", "-rs", "integration/test_observability.py", *session.posargs)


@nox.session
def mutation(session: nox.Session) -> None:
    """Mutation testing of the modules where a wrong rule corrupts results or lets someone in (mutation/targets.py).

    Prints the kill rate per module and the surviving mutants; not part of `nox -s tests`. Options after `--`:
    `--only "scheduler and policies"` (repeatable), `--sample N`, `--cap K`, `--full`, `--max-children N`,
    `--no-tables`.
    """
    install(session, "pytest>=8", "pytest-timeout", "numpy", "expecttest", "mutmut==3.8.1")
    session.run("python", "mutation/session.py", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """Install everything and run the quickstart on an embedded local cluster."""
    install(session)
    session.run("python", "examples/quickstart.py")


@nox.session
def build(session: nox.Session) -> None:
    """Wheels and sdists of every package, built with hatch, into dist/."""
    session.install("hatch")
    dist = str(Path("dist").resolve())
    for package in PACKAGES:
        with session.chdir(package):
            session.run("hatch", "build", "-t", "wheel", "-t", "sdist", dist)


@nox.session
def compat(session: nox.Session) -> None:
    """Each package's previous release tag against HEAD: older clients with newer controllers and workers work,
    the refused combinations say so in one line (integration/compat.py; the policy: docs/architecture.md)."""
    session.install(TORCH)
    # the DTorch packages come from the builds, per process; pytest: integration/_helpers (the processes' starters)
    session.install("hatch", "pytest", *third_party_dependencies())
    session.run("python", "integration/compat.py", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, and the import rules of `.importlinter` (layers, torch-free packages; docs/architecture.md)."""
    session.install("ruff", "import-linter")
    session.run("ruff", "check", ".")
    sources = os.pathsep.join(str(Path(p, "src").resolve()) for p in PACKAGES)  # read, never imported: no torch
    session.run("lint-imports", "--no-cache", env={"PYTHONPATH": sources})


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks print their figures; nothing here is a pass/fail timing."""
    install(session, "transformers", "diffusers")
    session.run("python", "benchmarks/bench_foundation.py", *session.posargs)
    session.run("python", "benchmarks/bench_models.py")  # SD3 transformer step (TP, SP), MoE layer (EP) vs torch
    session.run("python", "benchmarks/bench_scheduler.py")  # 10,000 fake workers, 1,000 queued sessions
    session.run("python", "benchmarks/bench_core_scale.py")  # the core's longest events on 1,024 and 4,096 workers
    session.run("python", "benchmarks/bench_recovery.py")  # SIGKILL detection and recovery, migration downtime
    session.run("python", "benchmarks/bench_recovery.py", "--core")  # the same core at 10,000 workers
    session.run("python", "benchmarks/bench_sim.py")  # simulator: 10,000 fake workers, 20,000 jobs; events/s
    session.run("python", "benchmarks/bench_fgd.py")  # FGD's inflation experiment on the pool: FGD vs best fit
    session.run("python", "benchmarks/bench_vs_torch.py")  # DTorch vs torch DTensor (2 gloo ranks) vs plain torch
    session.run("python", "benchmarks/bench_instructions.py")  # controller: instructions/s, eager vs replayed steps
    session.run("python", "benchmarks/bench_uploads.py")  # uploads with recovery backups off, in the stream, behind
    session.run("python", "benchmarks/bench_shards.py")  # whole shards between workers: segments vs streamed


@nox.session
def conformance(session: nox.Session) -> None:
    """Op coverage: every OpInfo of PyTorch's op database on DTensors vs torch (a few minutes).

    Writes conformance-report/conformance.{md,json}; options go after `--`, e.g. `--ops add,cat`.
    """
    install(session, "numpy", "expecttest")
    session.run("python", "-m", "dtorch.testing.conformance", "conformance-report", *session.posargs)


@nox.session
def gpu_integration(session: nox.Session) -> None:
    """GPU-marked tests (integration/test_gpu.py): one CUDA device tests the backend, ops and training, a mixed
    cuda/cpu cluster, recovery, and TP and DP x TP on two workers sharing it; two add NCCL collectives, TP and
    DP x TP across GPUs. Whatever the machine lacks is skipped with a one-line reason: each test is named with its
    outcome (-v) and the skips are listed with their reasons at the end (-rs); without CUDA every test is skipped
    and the session passes. With CUDA, benchmarks/bench_gpu.py then prints DTorch's CUDA worker against plain
    torch on the same GPU."""
    install(session, *TEST_DEPS)
    # silent: stdout and stderr together, where torch may warn first (NVML): the count is the last line
    out = session.run("python", "-W", "ignore", "-c", "import torch; print(torch.cuda.device_count())", silent=True)
    gpus = int((out or "0").strip().splitlines()[-1])
    session.log(f"CUDA devices on this machine: {gpus}")
    session.run("pytest", "-v", "-rs", "-m", "gpu", *session.posargs)
    if gpus:
        session.run("python", "benchmarks/bench_gpu.py")
