"""Upload time with recovery backups off, copied in the worker's stream (as before), and copied in the background
(issue #12 item 5), printed, never asserted. Real processes: a local cluster of 2 CPU workers per mode.

A step: upload a (rows x 1024) float32 batch Shard(0) over 2 workers (`distribute_tensor`), run a few matmuls on
it, read a scalar back (the sync point). Backups are two copies of each uploaded shard (one local in host
memory, one on the other worker); in the stream they run before the matmuls, in the background beside them.
Printed per mode: the median time `distribute_tensor` takes on the user's thread and the median whole step.

Then what the client holds of its uploads' sources (`_uploads` rule 1) in a loop that streams: a fresh batch a step,
and a sync point (a scalar read) every `--sync-every` steps, as a loop that logs its loss now and then. Printed: the
largest growth of the client's resident memory over the loop, in MiB and in batches (before protocol 1.13 the
client kept every batch until the next sync point).

    python benchmarks/bench_uploads.py [--mb 32] [--repeats 7] [--steps 30] [--sync-every 10]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch

import dtorch
from dtorch import Replicate, Shard

MODES = {  # name -> environment of the cluster it starts
    "backups off (recovery off)": {"DTORCH_SNAPSHOT_BATCHES": "0"},
    "backups in the stream": {"DTORCH_SYNC_BACKUPS": "1"},
    "backups in the background": {},
}


def measure(mb: int, repeats: int) -> tuple[float, float]:
    """(median upload ms, median step ms) on the current session."""
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    rows = (mb << 20) // (1024 * 4)
    w = dtorch.distribute_tensor(torch.randn(1024, 1024) / 32, mesh, [Replicate()])
    batch = torch.randn(rows, 1024)
    expected = None
    uploads, steps = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        x = dtorch.distribute_tensor(batch, mesh, [Shard(0)])
        t1 = time.perf_counter()
        for _ in range(4):
            x = x @ w
        got = x.sum().item()
        t2 = time.perf_counter()
        expected = got if expected is None else expected
        assert got == expected
        uploads.append(t1 - t0)
        steps.append(t2 - t0)
    return statistics.median(uploads[1:]) * 1e3, statistics.median(steps[1:]) * 1e3


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def held_while_streaming(mb: int, steps: int, sync_every: int) -> float:
    """The client's largest resident-memory growth (MiB) over `steps` steps that each upload a fresh batch."""
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    rows = (mb << 20) // (1024 * 4)
    w = dtorch.distribute_tensor(torch.randn(1024, 1024) / 32, mesh, [Replicate()])
    loss = (dtorch.distribute_tensor(torch.randn(rows, 1024), mesh, [Shard(0)]) @ w).sum()
    loss.item()  # warm: the first upload's buffers are not what this measures
    base = peak = rss_mib()
    for step in range(1, steps + 1):
        x = dtorch.distribute_tensor(torch.randn(rows, 1024), mesh, [Shard(0)])  # the user keeps no reference
        loss = (x @ w).sum()
        del x
        peak = max(peak, rss_mib())
        if step % sync_every == 0:
            loss.item()
        time.sleep(0.05)  # the rest of a step on the client (data loading, logging)
    return peak - base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sync-every", type=int, default=10)
    args = p.parse_args()
    os.environ.setdefault("DTORCH_HEARTBEAT_TIMEOUT", "10")  # big copies on 2 cores: no false losses
    rows = []
    for name, env in MODES.items():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            dtorch.connect(workers=2)
            rows.append((name, *measure(args.mb, args.repeats)))
        finally:
            dtorch.shutdown()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    print(f"Uploads of {args.mb} MiB (Shard(0) over 2 CPU workers), then 4 matmuls and a scalar back; medians of "
          f"{args.repeats}")
    print("  mode                          upload ms   step ms")
    for name, up, step in rows:
        print(f"  {name:28s} {up:10.1f}   {step:7.1f}")
    dtorch.connect(workers=2)
    try:
        held = held_while_streaming(args.mb, args.steps, args.sync_every)
    finally:
        dtorch.shutdown()
    print(f"Streaming {args.steps} steps of a fresh {args.mb} MiB batch, a sync point every {args.sync_every}: the "
          f"client's memory grew by at most {held:.0f} MiB ({held / args.mb:.1f} batches) while it kept sources for "
          "recovery")


if __name__ == "__main__":
    main()
