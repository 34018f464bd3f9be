"""A worker that dies mid-session: the next sync point raises one clear line naming it; nothing hangs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, time
    import torch
    import dtorch
    from dtorch import Shard, runtime

    dtorch.connect(workers=2)
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    x = dtorch.ones(8, 4, device_mesh=mesh, placements=[Shard(0)])
    assert torch.equal(x.to_torch(), torch.ones(8, 4))
    os.kill(runtime._cluster.procs[2].pid, signal.SIGKILL)
    time.sleep(0.1)
    y = x * 2
    t0 = time.monotonic()
    try:
        y.to_torch()
    except Exception as e:
        print(f"{type(e).__name__}: {e}")
        print(f"waited {time.monotonic() - t0:.1f}")
""")


def test_killed_worker_is_reported_at_next_sync():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "DTORCH_CONTROLLER"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout
    error, waited = lines
    assert error.startswith("ClusterError: worker w") and "was lost" in error, error
    assert float(waited.split()[1]) < 10.0
