"""Whole shards between two workers of one host (snapshot copies, restores, moves): through a same-host segment
and streamed over gRPC, side by side in one run (printed, never asserted).

    python benchmarks/bench_shards.py [--mib 16 64 256] [--repeats 5]

Two pairs of workers in this process, each a real gRPC server on localhost: one pair as started by default (whole
shards on one host go through `dtorch_protocol.segments`), one with DTORCH_SHARED_MEMORY=0 (streamed, as between
hosts). For each size, a shard set of that many MiB (a base tensor and a view of it: one storage) is pushed
(PutShards: what a snapshot's remote copy and a move sent by its source do) and pulled (PullShards: what a restore
from another worker's copy and a frozen session's relocation do). Medians of --repeats, in GB/s and ms.
"""

from __future__ import annotations

import argparse
import os

import torch
from bench_vs_torch import median_ms  # the same timing as the other comparisons

from dtorch_protocol import auth
from dtorch_protocol.messages import ShardsRequest
from dtorch_worker import shards
from dtorch_worker.server import WorkerHandle, start_worker

SESSION = "bench-shards"


def pair(shared_memory: bool) -> tuple[WorkerHandle, WorkerHandle]:
    os.environ["DTORCH_SHARED_MEMORY"] = "1" if shared_memory else "0"  # read by each worker's peer pool
    try:
        a, b = start_worker(), start_worker()
    finally:
        del os.environ["DTORCH_SHARED_MEMORY"]
    a.executor.peers.grant(SESSION, {b.address: b.capability(SESSION, auth.PEER)})
    return a, b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    pairs = {"segment": pair(True), "streamed": pair(False)}
    print(f"whole shards between two workers of this host (medians of {args.repeats}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    print(f"{'MiB':>6} {'how':>9} {'push ms':>9} {'push GB/s':>10} {'pull ms':>9} {'pull GB/s':>10}")
    try:
        for mib in args.mib:
            base = torch.randn(mib << 18)
            items = [(1, 0, base), (2, 0, base[: base.numel() // 2])]
            for how, (a, b) in pairs.items():
                for tid, dev, value in items:
                    b.store.put((f"{SESSION}#s1", tid, dev), value)

                def push(a=a, b=b, items=items) -> None:  # noqa: ANN001
                    a.executor.peers.put_shards(b.address, shards.pack(items), SESSION, namespace=f"{SESSION}#s2",
                                                sender=a.address, host=True)

                def pull(a=a, b=b, base=base) -> None:  # noqa: ANN001
                    got = a.executor.peers.pull_shards(b.address, ShardsRequest(session=f"{SESSION}#s1",
                                                                                devices={0: [1, 2]}), SESSION)
                    assert torch.equal(got[0][2], base)

                push_ms, pull_ms = (median_ms(f, args.repeats, warmup=1) for f in (push, pull))
                nbytes = base.numel() * 4
                print(f"{mib:>6} {how:>9} {push_ms:9.1f} {nbytes / push_ms / 1e6:10.2f} {pull_ms:9.1f} "
                      f"{nbytes / pull_ms / 1e6:10.2f}")
    finally:
        for a, b in pairs.values():
            a.stop(0)
            b.stop(0)


if __name__ == "__main__":
    main()
