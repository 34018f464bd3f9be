import subprocess
import sys

from dtorch_sim import __version__


def test_cli_reports_version_and_refuses_to_pretend():
    out = subprocess.run([sys.executable, "-m", "dtorch_sim", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and __version__ in out.stdout
    run = subprocess.run([sys.executable, "-m", "dtorch_sim", "run", "x.yaml"], capture_output=True, text=True)
    assert run.returncode == 2 and "not built yet" in run.stderr
