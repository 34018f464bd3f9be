import subprocess
import sys

from dtorch_sim import __version__


def test_cli_reports_version():
    out = subprocess.run([sys.executable, "-m", "dtorch_sim", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and __version__ in out.stdout


def test_cli_reports_an_unreadable_scenario_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dtorch_sim", "run", str(tmp_path / "x.yaml")],
                         capture_output=True, text=True)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1 and "cannot read" in out.stderr


def test_cli_set_overrides_fields_and_reports_bad_paths(tmp_path):
    from pathlib import Path

    scenario = Path(__file__).resolve().parents[3] / "scenarios" / "synthetic-small.yaml"
    ok = subprocess.run([sys.executable, "-m", "dtorch_sim", "validate", str(scenario), "--set",
                         "cluster.nodes.0.count=10", "--set", "policy={name: dtorch}"], capture_output=True, text=True)
    assert ok.returncode == 0 and "(88 devices, policy dtorch)" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "dtorch_sim", "validate", str(scenario), "--set",
                          "cluster.nodes.5.count=1"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.strip() == (
        "--set cluster.nodes.5.count=1: cluster.nodes has no item '5' (a list of 2)")
