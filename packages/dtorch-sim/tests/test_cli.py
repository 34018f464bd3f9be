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
