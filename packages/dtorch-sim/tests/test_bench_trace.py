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
