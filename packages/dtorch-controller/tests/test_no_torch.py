"""The controller never imports torch: it starts fast and runs where torch is not installed."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_controller_leaves_torch_out():
    code = ("import sys, dtorch_controller.server, dtorch_controller.core, dtorch_controller.cli, "
            "dtorch_controller.status_view; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
