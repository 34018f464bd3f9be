"""`dtorch-sim`: validate a scenario, run it, or compare placement policies on it.

    dtorch-sim validate scenario.yaml
    dtorch-sim run scenario.yaml --out DIR
    dtorch-sim compare scenario.yaml --policies fifo,... --out DIR

A bad scenario is reported as one line per mistake (`field.path: what was expected`) and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dtorch_sim import __version__, feasible
from dtorch_sim.harness import Stalled
from dtorch_sim.jobs import JobSpec, end_guess, generate, node_groups, warnings
from dtorch_sim.policies import UnknownPolicy, is_known, known, make_policy
from dtorch_sim.scenario import LIMITS, Scenario, ScenarioError, load


def _simulate(sc: Scenario, out: Path, console: Console, quiet: bool, plots: bool = True):
    """Run one scenario; (summary, wall seconds, the plots' series, the names of the plots written). Raises
    Stalled."""
    from dtorch_sim import metrics
    from dtorch_sim.harness import Simulation

    started = time.perf_counter()
    sim = Simulation(sc)
    # the description is the scenario's name and the policy's, shown as they are: as markup, "[fifo]" vanished
    with Progress(TextColumn("{task.description}", style="bold", markup=False), BarColumn(),
                  TextColumn("{task.completed}/{task.total} jobs"), TextColumn("t={task.fields[now]:.0f}s"),
                  TimeElapsedColumn(), console=console,
                  disable=quiet, transient=True) as progress:
        task = progress.add_task(f"{sc.name} [{sc.policy.name}]", total=len(sim.jobs), now=0.0)
        for now in sim.run():
            progress.update(task, completed=sim.jobs_ended(), now=now)
    wall = time.perf_counter() - started
    failed = [r for r in sim.jobs if r.failed is not None]
    if failed:  # the table counts them; why is in jobs.csv, and the first reason here
        jobs = f"{len(failed):,} job{'s' if len(failed) != 1 else ''}"
        console.print(f"note: {jobs} failed ({failed[0].spec.id}: {failed[0].error}); jobs.csv's error column says "
                      "why each one did", markup=False, highlight=False)
    summary = metrics.write(sim, out, plots=False)
    pngs = [path.name for path in metrics.plot(sim, out)] if plots else []
    return summary, wall, metrics.series(sim), pngs


def _samples_problem(sc: Scenario, specs: list[JobSpec], source: str) -> str | None:
    """A sample interval so short that the run's samples would not fit (it ran out of memory, sampling)."""
    interval = sc.metrics.sample_interval_s
    end = end_guess(sc, specs)
    if interval is None or end / interval <= LIMITS["samples"]:
        return None
    return (f"{source}: metrics.sample_interval_s: {interval:g} s makes about {end / interval:,.0f} samples over "
            f"the run's ~{end:,.0f} s, more than the {LIMITS['samples']:,} a run keeps: use "
            f"{end / LIMITS['samples']:.2g} s or more")


def _heartbeats_problem(sc: Scenario, specs: list[JobSpec], source: str) -> str | None:
    """A run so long for its heartbeat that the idle heartbeats alone cannot be simulated: each heartbeat slot with a
    due worker is an event, so a run of ~end s makes end * min(devices, batch_slots) / interval_s of them (arrivals
    1e300 s apart, or a job of 1e300 s, ran forever)."""
    hb = sc.heartbeat
    devices = sum(g.count * g.devices_per_node for g in node_groups(sc))
    end = end_guess(sc, specs)
    events = end * (min(devices, hb.batch_slots) if hb.batch_slots else devices) / hb.interval_s
    if events <= LIMITS["heartbeat_events"]:
        return None
    return (f"{source}: the run's ~{end:,.3g} s with heartbeat.interval_s {hb.interval_s:g} make about {events:,.3g} "
            f"heartbeat events, more than the {LIMITS['heartbeat_events']:,} a run can take: give duration_s, a "
            "longer interval_s, or check the workload's times")


def _outputs(folders: list[Path]) -> str | None:
    """Make the output folders before anything runs; a folder that cannot be written is one line (after a long run it
    was a traceback, and the run was lost)."""
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".dtorch-sim-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as e:
            return f"--out {folder}: cannot write results there: {e.strerror or e}"
    return None


def _table(rows: list[tuple[dict, float]]) -> Table:
    """One column per run (policy), one row per metric: stays readable in 80 columns."""
    table = Table(title="dtorch-sim summary")
    table.add_column("metric")
    for s, _wall in rows:
        table.add_column(s["policy"], justify="right")

    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    lines = [
        ("jobs finished", lambda s, w: f"{s['jobs']['finished']}/{s['jobs']['submitted']}"),
        ("jobs failed / restarts", lambda s, w: f"{s['jobs']['failed']} / {s['jobs']['restarts']}"),
        ("JCT mean / p50 / p99 (s)", lambda s, w: " / ".join(f(s["jct_s"][k]) for k in ("mean", "p50", "p99"))),
        ("JCT floor mean / p99 (no wait, s)", lambda s, w: " / ".join(f(s["jct_floor_s"][k])
                                                                      for k in ("mean", "p99"))),
        ("queueing delay mean / p50 / p99 (s)", lambda s, w: " / ".join(f(s["queueing_delay_s"][k])
                                                                        for k in ("mean", "p50", "p99"))),
        ("frozen per job mean / p99 (s)", lambda s, w: " / ".join(f(s["frozen_s"][k]) for k in ("mean", "p99"))),
        ("frozen share of JCT mean / p99", lambda s, w: " / ".join(f(s["frozen_share_of_jct"][k], "{:.1%}")
                                                                   for k in ("mean", "p99"))),
        ("makespan (s)", lambda s, w: f(s["makespan_s"])),
        ("devices busy / allocated", lambda s, w: f"{f(s['utilization']['busy_mean'], '{:.1%}')} / "
                                                  f"{f(s['utilization']['allocated_mean'], '{:.1%}')}"),
        ("unallocated (all / queued)", lambda s, w: " / ".join(
            f(s["utilization"][k], "{:.1%}") for k in ("unallocated_share_mean", "unallocated_share_when_queued"))),
        ("preemptions / relocations / migrations", lambda s, w: f"{s['scheduling']['preemptions']} / "
                                                                f"{s['scheduling'].get('relocations', 0)} / "
                                                                f"{s['scheduling']['migrations']}"),
        ("failures detected/injected", lambda s, w: f"{s['failures']['detected']}/{s['failures']['injected']}"),
        ("detection / recovery max (s)", lambda s, w: f"{f(s['failures']['detection_s']['max'], '{:.2f}')} / "
                                                      f"{f(s['failures']['recovery_s']['max'], '{:.2f}')}"),
        ("device-s lost to failures", lambda s, w: f(s["failures"]["device_s_lost"], "{:,.0f}")),
        ("core events", lambda s, w: f"{s['events_handled']:,}"),
        ("simulated events/s (wall)", lambda s, w: f(s["events_handled"] / w if w > 0 else None, "{:,.0f}")),
        ("wall time (s)", lambda s, w: f(w, "{:.2f}")),
    ]
    for name, cell in lines:
        table.add_row(name, *(cell(s, w) for s, w in rows))
    return table


BROKEN_PIPE_STATUS = 128 + 13  # killed by SIGPIPE, what a shell reports for a Unix tool whose reader left


def main(argv: list[str] | None = None) -> int:
    """The command; a reader that goes away (`| head`, `| true`) ends it quietly, not with a BrokenPipeError."""
    try:
        return _main(argv)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at the interpreter's final flush
        return BROKEN_PIPE_STATUS


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="dtorch-sim", description="Simulate a DTorch cluster with the real "
                                     "controller core and simulated workers.")
    parser.add_argument("--version", action="version", version=f"dtorch-sim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check a scenario file; one line per mistake")
    v.add_argument("scenario")
    v.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="override a scenario field, e.g. --set cluster.nodes.0.count=48 (repeatable)")
    r = sub.add_parser("run", help="run a scenario, write metrics into --out")
    r.add_argument("scenario")
    r.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="override a scenario field, e.g. --set cluster.nodes.0.count=48 (repeatable)")
    r.add_argument("--out", default="sim-out", help="output folder (default: sim-out)")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    c = sub.add_parser("compare", help="run a scenario once per policy, one output folder each")
    c.add_argument("scenario")
    c.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="override a scenario field, e.g. --set cluster.nodes.0.count=48 (repeatable)")
    c.add_argument("--policies", required=True, help=f"comma-separated, known: {known()}")
    c.add_argument("--out", default="sim-compare", help="output folder; one subfolder per policy")
    c.add_argument("--quiet", action="store_true")
    c.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    err = Console(stderr=True, highlight=False, markup=False, soft_wrap=True)  # paths and names print as they are
    try:
        sc = load(args.scenario, args.set)
    except ScenarioError as e:
        for line in e.lines:
            print(line, file=sys.stderr)
        return 1
    specs = generate(sc)
    problems = feasible.problems(sc, specs, args.scenario)
    if not problems:
        problem = _samples_problem(sc, specs, args.scenario) or _heartbeats_problem(sc, specs, args.scenario)
        problems = [problem] if problem else []
    if problems:
        for line in problems:
            print(line, file=sys.stderr)
        return 1
    notes = warnings(sc, specs) + feasible.warnings(sc, specs)
    if args.command == "validate":
        print(f"{args.scenario}: ok ({sum(g.count * g.devices_per_node for g in node_groups(sc))} devices, "
              f"policy {sc.policy.name})")
        for line in notes:
            print(line)
        return 0
    for line in notes:
        print(line, file=sys.stderr)
    # Piped or redirected output gets a wide console: a table that wraps at 80 columns cannot be read in a file.
    console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 240)
    names = _policy_names(args.policies) if args.command == "compare" else []
    problem = (_policies_problem(names, sc) if args.command == "compare" else None) or \
        _outputs([Path(args.out) / name for name in names] or [Path(args.out)])
    if problem:
        print(problem, file=sys.stderr)
        return 1
    try:
        if args.command == "run":
            summary, wall, _run, pngs = _simulate(sc, Path(args.out), err, args.quiet, not args.no_plots)
            console.print(_table([(summary, wall)]))
            files = ", ".join(["metrics.json", "jobs.csv", "utilization.csv", "failures.csv", *pngs])
            console.print(f"wrote {args.out}/{files}")
            return 0
        return _compare(args, sc, console, err)
    except Stalled as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _policy_names(text: str) -> list[str]:
    return list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))


def _policies_problem(names: list[str], sc: Scenario) -> str | None:
    """`--policies`: each known, and its parameters (`policy.params_for`) accepted by it."""
    unknown = [p for p in names if not is_known(p)]
    if unknown or not names:
        return (f"--policies: unknown policy {', '.join(map(repr, unknown)) or '(none given)'}: known policies are "
                f"{known()}")
    for name in names:
        try:
            make_policy(name, sc.policy.for_name(name))
        except UnknownPolicy as e:
            return f"policy.params_for.{name}: {e}"
    return None


def _compare(args: argparse.Namespace, sc: Scenario, console: Console, err: Console) -> int:
    from dtorch_sim import metrics

    names = _policy_names(args.policies)
    rows, runs = [], []
    for name in names:
        summary, wall, run, _pngs = _simulate(sc.with_policy(name), Path(args.out) / name, err, args.quiet,
                                              not args.no_plots)
        rows.append((summary, wall))
        runs.append(run)
    pngs = [] if args.no_plots else [path.name for path in metrics.plot_compare(runs, Path(args.out))]
    console.print(_table(rows))
    console.print(f"wrote one folder per policy under {args.out}"
                  + (f", and {', '.join(pngs)} overlaying them" if pngs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
