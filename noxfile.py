"""Every job of the DTorch monorepo. `nox -s tests` is what CI runs."""

from __future__ import annotations

import os
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
TEST_DEPS = ["pytest>=8", "pytest-timeout", "numpy", "expecttest", "transformers", "import-linter"]


def install(session: nox.Session, *extra: str) -> None:
    session.install(TORCH)
    session.install(*[arg for p in PACKAGES for arg in ("-e", p)], *extra)


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite: unit tests of each package and integration tests with real processes."""
    install(session, *TEST_DEPS)
    session.run("pytest", "-q", "-m", "not gpu", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """Install everything and run the quickstart on an embedded local cluster."""
    install(session)
    session.run("python", "examples/quickstart.py")


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
    install(session)
    session.run("python", "benchmarks/bench_foundation.py", *session.posargs)
    session.run("python", "benchmarks/bench_scheduler.py")  # 10,000 fake workers, 1,000 queued sessions
    session.run("python", "benchmarks/bench_recovery.py")  # SIGKILL detection and recovery, migration downtime
    session.run("python", "benchmarks/bench_recovery.py", "--core")  # the same core at 10,000 workers
    session.run("python", "benchmarks/bench_sim.py")  # simulator: 10,000 fake workers, 20,000 jobs; events/s


@nox.session
def conformance(session: nox.Session) -> None:
    """Op coverage: every OpInfo of PyTorch's op database on DTensors vs torch (a few minutes).

    Writes conformance-report/conformance.{md,json}; options go after `--`, e.g. `--ops add,cat`.
    """
    install(session, "numpy", "expecttest")
    session.run("python", "-m", "dtorch.testing.conformance", "conformance-report", *session.posargs)


@nox.session
def gpu_integration(session: nox.Session) -> None:
    """GPU-marked tests; on a machine without CUDA it says so and tests nothing."""
    install(session, *TEST_DEPS)
    has_cuda = session.run("python", "-c", "import torch; print(int(torch.cuda.is_available()))", silent=True)
    if has_cuda is None or has_cuda.strip() != "1":
        session.log("no CUDA device on this machine: skipped the GPU integration tests (nothing was tested)")
        return
    session.run("pytest", "-q", "-m", "gpu", *session.posargs)
