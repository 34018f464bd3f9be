"""benchmarks/bench_sim_trace.py as an operator runs it: its report lines and its options."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_sim_trace.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_sim_trace", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_run_in_which_no_job_finished_reports_none_for_its_makespan_and_jcts(bench, monkeypatch, capsys):
    """The report divided the makespan (null when no job finished) by 3600: a TypeError after the whole run."""
    scenario = bench.scenario

    def stopped_early(*args, **kwargs):
        return {**scenario(*args, **kwargs), "duration_s": 1.0}  # before any job could finish

    monkeypatch.setattr(bench, "scenario", stopped_early)
    monkeypatch.setattr("sys.argv", ["bench_sim_trace.py", "--jobs", "3", "--devices", "8", "--policies", "fifo"])
    bench.main()
    out = capsys.readouterr().out
    assert "0/3" in out and "makespan none, mean JCT none, p99 none, busy " in out


@pytest.mark.parametrize(("argv", "line"), [
    (["--jobs", "0"], "argument --jobs: expected a number of jobs >= 1, got '0'"),
    (["--devices", "0"], "argument --devices: expected comma-separated cluster sizes, multiples of 8 (nodes of 8), "
                         "got '0'"),
    (["--devices", "512,7"], "argument --devices: expected comma-separated cluster sizes, multiples of 8 (nodes of "
                             "8), got '512,7'"),
    (["--policies", "fifo,tiresias"], "argument --policies: unknown policy 'tiresias': known policies are dtorch, "
                                      "fifo, las, priority"),
    (["--params", "[1]"], "argument --params: expected a JSON object of policy parameters, got '[1]'"),
])
def test_bad_options_are_one_line_before_the_run(bench, monkeypatch, capsys, argv, line):
    """Each was a traceback, some after the trace was written (--devices 0: a ZeroDivisionError; --jobs 0: 'no job
    left to simulate' from a temporary file)."""
    monkeypatch.setattr("sys.argv", ["bench_sim_trace.py", *argv])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == f"bench_sim_trace.py: error: {line}"


def test_a_parameter_the_policy_does_not_take_is_one_line(bench, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["bench_sim_trace.py", "--jobs", "3", "--devices", "8", "--policies", "las",
                                     "--params", '{"bogus": 1}'])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2
    assert capsys.readouterr().err == ("bench_sim_trace.py: policy.params_for.las: policy 'las' takes no parameter "
                                       "'bogus' (it takes thresholds, starve_factor, starve_min_s, preempt, relocate, "
                                       "relocate_after)\n")
