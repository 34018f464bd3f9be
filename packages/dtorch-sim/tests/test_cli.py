import subprocess
import sys
from pathlib import Path

from dtorch_sim import __version__

SMALL = Path(__file__).resolve().parents[3] / "scenarios" / "synthetic-small.yaml"


def test_cli_reports_version():
    out = subprocess.run([sys.executable, "-m", "dtorch_sim", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and __version__ in out.stdout


def test_cli_reports_an_unreadable_scenario_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dtorch_sim", "run", str(tmp_path / "x.yaml")],
                         capture_output=True, text=True)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1 and "cannot read" in out.stderr


def test_cli_set_overrides_fields_and_reports_bad_paths(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "dtorch_sim", "validate", str(SMALL), "--set",
                         "cluster.nodes.0.count=10", "--set", "policy={name: dtorch}"], capture_output=True, text=True)
    assert ok.returncode == 0 and "(88 devices, policy dtorch)" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "dtorch_sim", "validate", str(SMALL), "--set",
                          "cluster.nodes.5.count=1"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.strip() == (
        "--set cluster.nodes.5.count=1: cluster.nodes has no item '5' (a list of 2)")


def test_an_output_folder_that_cannot_be_written_is_one_line_before_anything_runs(tmp_path):
    """--out naming a file was a traceback from mkdir after the whole simulation had run (minutes, lost)."""
    (tmp_path / "taken").write_text("")
    for command in (["run"], ["compare", "--policies", "fifo,las"]):
        out = subprocess.run([sys.executable, "-m", "dtorch_sim", *command, str(SMALL), "--quiet", "--no-plots",
                              "--out", str(tmp_path / "taken")], capture_output=True, text=True)
        folder = tmp_path / "taken" / ("fifo" if command[0] == "compare" else "")
        assert out.returncode == 1 and out.stdout == "", out.stderr
        assert out.stderr.splitlines() == [f"--out {str(folder).rstrip('/')}: cannot write results there: "
                                           f"{'File exists' if command == ['run'] else 'Not a directory'}"]
    out = subprocess.run([sys.executable, "-m", "dtorch_sim", "compare", str(SMALL), "--policies", "fifo,srtf",
                          "--out", str(tmp_path / "cmp")], capture_output=True, text=True)
    assert out.returncode == 1 and "unknown policy 'srtf'" in out.stderr and not (tmp_path / "cmp").exists()


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`dtorch-sim validate x.yaml | true` was a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "dtorch_sim", "validate", str(SMALL)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before it writes: its first line meets a closed pipe
    assert proc.wait(timeout=60) == 141 and proc.stderr.read() == ""


def test_why_a_job_failed_is_in_jobs_csv_and_the_first_reason_is_printed(tmp_path):
    """A failed job was a count in the summary and nothing else: its error (here the controller's refusal of a mesh
    over its logical-device limit) was kept in memory and never written."""
    import csv
    out = subprocess.run([sys.executable, "-m", "dtorch_sim", "run", str(SMALL), "--quiet", "--no-plots", "--out",
                          str(tmp_path), "--set", "workload.synthetic.size={choices: [3000, 1]}", "--set",
                          "workload.synthetic.jobs=3"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader((tmp_path / "jobs.csv").open()))
    failed = [r for r in rows if r["failed_s"]]
    assert failed and all(r["error"].startswith("OpenMesh refused") for r in failed), rows
    assert all(r["error"] == "" for r in rows if not r["failed_s"])
    assert f"note: {len(failed)} jobs failed ({failed[0]['job_id']}: OpenMesh refused" in out.stderr


def _refused_by_validate_and_run(tmp_path, setting: str, message: str):
    """`validate` and `run` of synthetic-small with `--set setting` both refuse with `message` (its `{scenario}`
    filled in) before running anything."""
    for command in ("validate", "run"):
        out = subprocess.run([sys.executable, "-m", "dtorch_sim", command, str(SMALL), "--set", setting,
                              *(["--out", str(tmp_path)] * (command == "run"))], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 1 and out.stdout == "", out.stderr
        assert out.stderr == message.format(scenario=SMALL)


def test_a_sample_interval_too_short_for_the_run_is_refused_before_it_runs(tmp_path):
    """metrics.sample_interval_s: 0.000001 sampled 1.4 billion times over a 1,400 s run: gigabytes, then out of
    memory, and validate said ok."""
    _refused_by_validate_and_run(tmp_path, "metrics.sample_interval_s=0.000001", (
        "{scenario}: metrics.sample_interval_s: 1e-06 s makes about 1,399,189,900 samples over the run's ~1,399 s, "
        "more than the 1,000,000 a run keeps: use 0.0014 s or more\n"))
    ok = subprocess.run([sys.executable, "-m", "dtorch_sim", "validate", str(SMALL), "--set",
                         "metrics.sample_interval_s=0.0014"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


def test_the_progress_line_names_the_scenario_and_the_policy_as_they_are(base, tmp_path):
    """The policy in brackets was read as rich markup and vanished ('tiny  ━━━ 3/12 jobs': compare's bars looked
    alike), and a name such as 'x[bold red]y' restyled the line."""
    from rich.console import Console

    from dtorch_sim import cli
    from dtorch_sim.scenario import parse

    base["name"] = "x[bold red]y"
    console = Console(record=True, force_terminal=True, width=200)
    cli._simulate(parse(base), tmp_path, console, quiet=False, plots=False)
    assert "x[bold red]y [fifo]" in console.export_text()


def test_an_output_folder_with_brackets_is_printed_as_it_is(tmp_path):
    """`--out 'res[v2]'` was printed as 'wrote res/metrics.json' (rich markup), and `--out 'o[/]'` ended a finished run
    with a MarkupError traceback."""
    for name in ("res[v2]", "o[/]"):
        out = subprocess.run([sys.executable, "-m", "dtorch_sim", "run", str(SMALL), "--quiet", "--no-plots",
                              "--set", "workload.synthetic.jobs=2", "--out", str(tmp_path / name)],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert f"wrote {tmp_path / name}/metrics.json" in out.stdout


def test_the_closing_line_names_the_files_the_run_wrote(tmp_path):
    """`run --no-plots` ended with "wrote .../metrics.json, jobs.csv, utilization.csv, failures.csv (+ plots)", and no
    plot was there; `compare --no-plots` said nothing of plots, but with them it named two without looking."""
    for plots, folder in (([], "plain"), (["--no-plots"], "bare")):
        out = subprocess.run([sys.executable, "-m", "dtorch_sim", "run", str(SMALL), "--quiet", *plots,
                              "--set", "workload.synthetic.jobs=2", "--out", str(tmp_path / folder)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        named = out.stdout.strip().splitlines()[-1].removeprefix(f"wrote {tmp_path / folder}/").split(", ")
        assert sorted(named) == sorted(p.name for p in (tmp_path / folder).iterdir())
        assert any(name.endswith(".png") for name in named) == (not plots)
    out = subprocess.run([sys.executable, "-m", "dtorch_sim", "compare", str(SMALL), "--quiet", "--policies",
                          "fifo,las", "--set", "workload.synthetic.jobs=2", "--out", str(tmp_path / "both")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pngs = sorted(p.name for p in (tmp_path / "both").iterdir() if p.is_file())
    assert pngs == ["jct_cdf.png", "utilization.png"]
    assert out.stdout.strip().splitlines()[-1] == (f"wrote one folder per policy under {tmp_path / 'both'}, and "
                                                   "jct_cdf.png, utilization.png overlaying them")


def test_a_run_too_long_for_its_heartbeat_is_refused_before_it_runs():
    """Arrivals 1e300 s apart validated ok and the run never ended: idle workers beat through the whole span."""
    out = subprocess.run([sys.executable, "-m", "dtorch_sim", "validate", str(SMALL), "--set",
                          "workload.synthetic.duration={dist: constant, value: 1e300}"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (f"{SMALL}: the run's ~1e+300 s with heartbeat.interval_s 1 make about 3.2e+301 heartbeat "
                          "events, more than the 100,000,000 a run can take: give duration_s, a longer interval_s, or "
                          "check the workload's times\n")
    ok = subprocess.run([sys.executable, "-m", "dtorch_sim", "validate", str(SMALL), "--set",
                         "workload.synthetic.duration={dist: constant, value: 1e300}", "--set", "duration_s=3600"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr


def test_a_cost_no_job_can_pay_before_the_run_ends_is_refused_before_it_runs(tmp_path):
    """cost.launch_s: 1e300 validated ok, ran a minute of events and reported 0/40 jobs finished, with no word. Each
    per-job cost (feasible.PER_JOB) is refused in one line naming the field and the range that lets a job finish."""
    _refused_by_validate_and_run(tmp_path, "cost.launch_s=1e300", (
        "{scenario}: cost.launch_s: 1e+300 s per command (at least one a step) leaves no job able to finish by the "
        "run's end (~106,358 s: the last arrival + 10x the jobs' total work + 1 h): expected 0 <= launch_s < "
        "1.06e+04 s\n"))
    out = subprocess.run([sys.executable, "-m", "dtorch_sim", "validate", str(SMALL), "--set", "duration_s=100",
                          "--set", "cost.rpc_latency_s=60"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr == (
        f"{SMALL}: cost.rpc_latency_s: 60 s per delivery (at least one a Sync) leaves no job able to finish by the "
        "run's end (~100 s: duration_s): expected 0 <= rpc_latency_s < 49.4 s\n")
    ok = subprocess.run([sys.executable, "-m", "dtorch_sim", "validate", str(SMALL), "--set", "duration_s=100",
                         "--set", "cost.rpc_latency_s=49", "--set", "cost.launch_s=9.8"], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr


def test_a_bandwidth_too_low_for_one_copy_in_the_run_is_a_warning(base):
    """A copy of the smallest state that outlasts the run: a job that is moved or snapshotted never ends."""
    from dtorch_sim import feasible
    from dtorch_sim.jobs import generate
    from dtorch_sim.scenario import parse

    sc = parse(base)
    assert feasible.warnings(sc, generate(sc)) == []
    base["cost"] = {"network_gbps": 1e-300}
    sc = parse(base)
    (line,) = feasible.warnings(sc, generate(sc))
    assert line.startswith("warning: cost.network_gbps: copying 2 GB (the smallest job state per device) takes "
                           "1.72e+301 s, longer than the run"), line
    assert "a job moved or rebuilt from another worker will not finish (expected network_gbps > " in line
