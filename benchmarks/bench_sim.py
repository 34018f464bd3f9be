"""Simulator speed: scenarios/scale-10k.yaml (10,000 fake workers, 20,000 jobs) through the real controller core.

Prints wall time, CPU time of this process (the fair figure on a shared machine), simulated time, core events and
simulated events per second. Nothing is asserted: the target (under 5 minutes on one core) is read off the output.

    python benchmarks/bench_sim.py                       # the full scale scenario
    python benchmarks/bench_sim.py --fraction 0.1        # 1,000 workers and 2,000 jobs, same load
    python benchmarks/bench_sim.py --profile 25          # and the 25 most expensive functions
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import time
from pathlib import Path

from dtorch_sim import metrics
from dtorch_sim.harness import Simulation
from dtorch_sim.scenario import load

ROOT = Path(__file__).resolve().parents[1]


def shrink(sc, fraction: float):
    """The same scenario on `fraction` of the nodes with `fraction` of the jobs (same offered load)."""
    if fraction == 1.0:
        return sc
    cluster = sc.cluster.model_copy(update={"nodes": [g.model_copy(update={"count": max(1, round(g.count * fraction))})
                                                      for g in sc.cluster.nodes]})
    wl = sc.workload
    syn = wl.synthetic
    assert syn is not None, "--fraction needs a synthetic workload"
    syn = syn.model_copy(update={"jobs": max(1, round(syn.jobs * fraction)),
                                 "arrival": syn.arrival.model_copy(update={"rate_per_s": syn.arrival.rate_per_s
                                                                           * fraction})})
    return sc.model_copy(update={"cluster": cluster, "workload": wl.model_copy(update={"synthetic": syn})})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(ROOT / "scenarios" / "scale-10k.yaml"))
    parser.add_argument("--fraction", type=float, default=1.0, help="scale nodes and jobs down (0 < f <= 1)")
    parser.add_argument("--policy", help="run under this policy instead of the scenario's")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N most expensive functions")
    args = parser.parse_args()
    sc = shrink(load(args.scenario), args.fraction)
    if args.policy:
        sc = sc.with_policy(args.policy)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    sim = Simulation(sc)
    setup_wall = time.perf_counter() - wall0
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    sim.run_all()
    if profiler:
        profiler.disable()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    s = metrics.summarize(sim)
    workers = len(sim.all_workers)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"scenario        {sc.name} (policy {sc.policy.name}): {workers:,} worker processes, "
          f"{len(sim.jobs):,} jobs")
    print(f"jobs            {s['jobs']['finished']:,} finished, {s['jobs']['unfinished']:,} unfinished, "
          f"{s['failures']['injected']} failures injected")
    print(f"simulated time  {sim.env.now:,.0f} s")
    print(f"core events     {sim.events:,}")
    print(f"wall time       {wall:.1f} s (setup {setup_wall:.1f} s)")
    print(f"CPU time        {cpu:.1f} s (this process; one core)")
    print(f"events/s        {sim.events / wall:,.0f} per wall second, {sim.events / cpu:,.0f} per CPU second")
    print(f"peak memory     {rss:,.0f} MiB")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
