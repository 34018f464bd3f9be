"""The packages as users install them: each lists what it imports, pins the protocol it speaks, and the controller
installs and runs without torch (a GPU cluster's head node must not pull a multi-GB CUDA wheel for it)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _helpers import Keys, start_controller, start_worker, stop_all
from dtorch_protocol import PROTOCOL_VERSION, __version__

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
DISTRIBUTIONS = {  # top-level import -> the distribution that provides it
    "dtorch": "dtorch-api", "dtorch_protocol": "dtorch-protocol", "dtorch_controller": "dtorch-controller",
    "dtorch_worker": "dtorch-worker", "dtorch_sim": "dtorch-sim", "torch": "torch", "grpc": "grpcio",
    "msgspec": "msgspec", "numpy": "numpy", "rich": "rich", "yaml": "pyyaml", "pydantic": "pydantic",
    "simpy": "simpy", "matplotlib": "matplotlib", "grpc_health": "grpcio-health-checking",
    "cryptography": "cryptography", "prometheus_client": "prometheus-client",
}


def project(package: str) -> dict:
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]


def requirement_names(package: str) -> dict[str, str]:
    """name -> full requirement, for the package's install dependencies."""
    out = {}
    for req in project(package)["dependencies"]:
        name = req.split(";")[0]
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        out[name.strip().lower()] = req
    return out


def module_level_imports(package: str) -> set[str]:
    """Top-level names imported at module level by the package's source (lazy imports inside functions excluded)."""
    names = set()
    for path in (ROOT / "packages" / package / "src").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__"}


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_lists_what_it_imports(package):
    imported = module_level_imports(package)
    unknown = imported - set(DISTRIBUTIONS)
    assert not unknown, f"{package} imports {sorted(unknown)}: add them to DISTRIBUTIONS (and to its dependencies)"
    needed = {DISTRIBUTIONS[name] for name in imported} - {package}
    missing = needed - set(requirement_names(package))
    assert not missing, f"{package} imports {sorted(missing)} but does not depend on them"


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "dtorch-protocol"])
def test_each_package_pins_the_protocol_minor_it_speaks(package):
    """`~=X.Y.0`: the dtorch-protocol it runs with names in its Hello the protocol it was written for."""
    assert requirement_names(package)["dtorch-protocol"].startswith(f"dtorch-protocol~={PROTOCOL_VERSION}.0")
    assert __version__.startswith(PROTOCOL_VERSION + ".")  # dtorch-protocol X.Y.Z speaks protocol X.Y


def test_the_controller_and_the_simulator_do_not_depend_on_torch():
    for package in ("dtorch-protocol", "dtorch-controller", "dtorch-sim"):
        assert not {"torch", "dtorch-api", "dtorch-worker"} & set(requirement_names(package)), package


CLIENT = textwrap.dedent("""
    import torch, dtorch
    from dtorch import DeviceMesh, Replicate, Shard
    a = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    x = dtorch.distribute_tensor(a, DeviceMesh("cpu", [0, 1]), [Shard(0)])
    y = (x @ x.T).redistribute(placements=[Replicate()])
    torch.testing.assert_close(y.to_torch(), a @ a.T)
    print("same as torch")
""")


def test_a_controller_installed_without_torch_serves_workers_and_clients(tmp_path):
    """pip installs the two wheels (built here, offline) and their declared dependencies (from the index)."""
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "-w", str(wheels), *(str(ROOT / "packages" / p) for p in ("dtorch-protocol",
                                                                                        "dtorch-controller"))],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                              *map(str, sorted(wheels.glob("*.whl")))], env=clean, capture_output=True, text=True,
                             timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    probe = "import importlib.util as u; print([m for m in ('torch', 'dtorch', 'numpy') if u.find_spec(m)])"
    assert subprocess.run([str(python), "-c", probe], env=clean, capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
    keys = Keys.make(tmp_path)
    env = {**{k: v for k, v in clean.items() if not k.startswith("DTORCH_")}, "DTORCH_KEYS": str(keys.path)}
    controller, address = start_controller(tmp_path / "address", env, "--heartbeat-timeout", "30",  # a loaded machine
                                           log=tmp_path / "controller.log",
                                           command=(str(venv / "bin" / "dtorch-controller"),))
    procs = [controller]
    try:
        procs += [start_worker(address, {**env, "DTORCH_API_KEY": keys.worker}, log=tmp_path / f"worker{i}.log")
                  for i in range(2)]  # main environment
        out = subprocess.run([sys.executable, "-c", CLIENT],
                             env={**env, "DTORCH_CONTROLLER": address, "DTORCH_API_KEY": keys.alice},
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0 and out.stdout.strip() == "same as torch", out.stderr[-3000:]
        assert controller.poll() is None, (tmp_path / "controller.log").read_text()[-3000:]
    finally:
        stop_all(procs)
