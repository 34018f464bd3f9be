"""Pointing the simulator at any trace: the generic `csv` format, its checks, and the warnings of `validate`."""

import subprocess
import sys

import pytest
import yaml

from dtorch_sim.jobs import generate, warnings
from dtorch_sim.scenario import ScenarioError, parse


@pytest.fixture
def base(base: dict) -> dict:
    """conftest's scenario less its 'slow' device type, which no node has: the warnings here are compared whole, and
    an unused type is a warning of its own (test_a_device_type_no_node_has_is_warned_about)."""
    del base["cluster"]["device_types"]["slow"]
    return base


def errors(data: dict) -> list[str]:
    with pytest.raises(ScenarioError) as e:
        parse(data)
    return e.value.lines


def csv_trace(base: dict, path, text: str, **trace) -> dict:
    path.write_text(text)
    base["workload"] = {"trace": {"format": "csv", "path": str(path), **trace}}
    return base


# Unsorted rows, datetimes, no job id column, two virtual clusters.
ROWS = ("when,gpus,secs,vc\n"
        "2024-03-01 10:00:30,2,60,a\n"
        "2024-03-01 10:00:00,1,30,b\n"
        "2024-03-01 10:01:00,4,90,a\n"
        "2024-03-01 10:00:10,1,45,a\n")
COLUMNS = {"submit": "when", "num_gpu": "gpus", "duration": "secs"}


def test_csv_maps_columns_names_jobs_by_row_reads_datetimes_and_sorts(base, tmp_path):
    csv_trace(base, tmp_path / "t.csv", ROWS, columns=COLUMNS, time_format="%Y-%m-%d %H:%M:%S")
    jobs = generate(parse(base))
    assert [(j.id, j.arrival, j.devices, j.duration) for j in jobs] == [
        ("row3", 0.0, 1, 30.0), ("row5", 10.0, 1, 45.0), ("row2", 30.0, 2, 60.0), ("row4", 60.0, 4, 90.0)]


def test_csv_iso_times_and_end_column(base, tmp_path):
    text = ("id,t0,t1,n\nx,2024-03-01T10:00:00+00:00,2024-03-01T10:02:00+00:00,1\n"
            "y,2024-03-01T11:00:00+01:00,2024-03-01T10:01:00Z,2\n")
    csv_trace(base, tmp_path / "t.csv", text, columns={"job_id": "id", "submit": "t0", "end": "t1", "num_gpu": "n"},
              time_format="iso")
    assert [(j.id, j.arrival, j.duration) for j in generate(parse(base))] == [("x", 0.0, 120.0), ("y", 0.0, 60.0)]


def test_csv_filter_keeps_one_virtual_cluster(base, tmp_path):
    csv_trace(base, tmp_path / "t.csv", ROWS, columns=COLUMNS, time_format="%Y-%m-%d %H:%M:%S",
              filter={"column": "vc", "values": ["a"]})
    assert [j.id for j in generate(parse(base))] == ["row5", "row2", "row4"]


def test_csv_partition_tags_groups_and_applies_quotas(base, tmp_path):
    csv_trace(base, tmp_path / "t.csv", ROWS, columns=COLUMNS, time_format="%Y-%m-%d %H:%M:%S",
              partition={"column": "vc", "quotas": {"a": 2, "b": 5}})
    jobs = generate(parse(base))
    assert [(j.id, j.group) for j in jobs] == [("row3", "b"), ("row5", "a"), ("row2", "a")]  # a's third is over quota
    base["workload"]["trace"]["partition"] = {"column": "vc", "quotas": {"a": 1}, "others": 0}
    assert [j.id for j in generate(parse(base))] == ["row5"]


def test_csv_checks_each_give_one_line(base, tmp_path):
    path = tmp_path / "t.csv"
    assert errors(csv_trace(base, path, ROWS, columns={"submit": "when"})) == [
        "workload.trace: format csv needs columns for submit, num_gpu, and duration or end: add num_gpu, duration "
        "or end to workload.trace.columns (role: CSV column name)"]
    assert errors(csv_trace(base, path, ROWS, columns=COLUMNS, time_format="YYYY-MM-DD")) == [
        "workload.trace: time_format must be 'seconds', 'iso' or a strptime pattern such as '%Y-%m-%d %H:%M:%S', "
        "got 'YYYY-MM-DD'"]
    (line,) = errors(csv_trace(base, path, ROWS, columns=COLUMNS, time_format="%d/%m/%Y"))
    assert line.startswith("workload.trace.path: line 2 of ") and line.endswith(
        ": submit value '2024-03-01 10:00:30' (column 'when') is not in time_format '%d/%m/%Y'")
    assert errors(csv_trace(base, path, ROWS, columns={**COLUMNS, "submit": "t"})) == [
        "workload.trace.columns: column 't' (for submit) is not in the CSV header ['when', 'gpus', 'secs', 'vc']"]
    assert errors(csv_trace(base, path, ROWS, columns=COLUMNS, time_format="%Y-%m-%d %H:%M:%S",
                            filter={"column": "cluster", "values": ["a"]})) == [
        "workload.trace.filter.column: column 'cluster' is not in the CSV header ['when', 'gpus', 'secs', 'vc']"]
    assert errors(csv_trace(base, path, ROWS, columns=COLUMNS, time_format="%Y-%m-%d %H:%M:%S",
                            partition={"column": "cluster", "quotas": {"a": 1}})) == [
        "workload.trace.partition.column: column 'cluster' is not in the CSV header ['when', 'gpus', 'secs', 'vc']"]
    lines = errors(csv_trace(base, path, ROWS, columns=COLUMNS, partition={"column": "vc", "quotas": {"a": 0}}))
    assert lines == ["workload.trace.partition.quotas: a quota is a number of jobs >= 1, got a: 0"]
    (line,) = errors(csv_trace(base, path, ROWS, columns=COLUMNS, time_format="%Y-%m-%d %H:%M:%S",
                               filter={"column": "vc", "values": ["zz"]}))
    assert line.startswith("workload.trace: no job left to simulate from ") and "filter on column 'vc'" in line


def test_validate_warns_about_jobs_larger_than_the_cluster_and_time_units(base, tmp_path):
    csv_trace(base, tmp_path / "t.csv", "t,n,d\n0,4,10\n1,16,10\n2,9,10\n", columns={"submit": "t", "num_gpu": "n",
                                                                                   "duration": "d"})
    sc = parse(base)
    assert warnings(sc, generate(sc)) == [
        "warning: workload: 2 of 3 jobs ask for more devices than the cluster's 8 at the start (up to 16): they run "
        "with several logical devices per device (virtual devices), slower (drop them with workload.trace.max_gpus, "
        "or add nodes)"]
    base["workload"]["trace"]["max_gpus"] = 8
    base["workload"]["trace"]["time_scale"] = 0.01
    sc = parse(base)
    assert warnings(sc, generate(sc)) == [
        "note: workload.trace: 1 of 3 rows of t.csv make jobs; skipped: 2 over max_gpus",
        "note: policy times (LAS thresholds, relocate_after, ...) are simulated seconds: they do not follow "
        "workload.trace.time_scale (0.01); scale them yourself (policy.params)"]
    scenario = tmp_path / "s.yaml"
    base["workload"]["trace"].pop("max_gpus")
    scenario.write_text(yaml.safe_dump(base))
    out = subprocess.run([sys.executable, "-m", "dtorch_sim", "validate", str(scenario)], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "warning: workload: 2 of 3 jobs ask for more devices" in out.stdout


def test_jobs_over_the_controllers_mesh_limit_are_warned_as_refused_not_as_slower(base, tmp_path):
    """The warning said a job of 600 devices on 8 would run slower on virtual devices; the core refuses a mesh over 64
    logical devices per device and the job failed at once."""
    from dtorch_sim.harness import Simulation

    csv_trace(base, tmp_path / "t.csv", "t,n,d\n0,600,10\n1,16,10\n", columns={"submit": "t", "num_gpu": "n",
                                                                            "duration": "d"})
    sc = parse(base)
    assert warnings(sc, generate(sc)) == [
        "warning: workload: 1 of 2 jobs ask for more devices than the cluster's 8 at the start (up to 16): they run "
        "with several logical devices per device (virtual devices), slower (drop them with workload.trace.max_gpus, "
        "or add nodes)",
        "warning: workload: 1 of 2 jobs ask for more than the controller accepts (64 logical devices per device: 512 "
        "on the cluster at the start; up to 600): it refuses their meshes and they fail at once (drop them with "
        "workload.trace.max_gpus, or add nodes)"]
    sim = Simulation(sc.model_copy(update={"duration_s": 5.0}))
    for _ in sim.run():
        pass
    big = next(r for r in sim.jobs if r.spec.devices == 600)
    assert big.failed is not None and big.placed is None


def test_a_job_the_controller_refuses_ends_and_the_run_stops_when_every_job_ended(base, tmp_path):
    """A refused job never counted as ended: the run went on, idle, until its horizon (the last arrival plus ten
    times the jobs' work plus an hour), and every utilization figure was averaged over that idle time too."""
    from dtorch_sim import metrics
    from dtorch_sim.harness import Simulation

    csv_trace(base, tmp_path / "t.csv", "t,n,d\n0,600,10\n1,2,10\n", columns={"submit": "t", "num_gpu": "n",
                                                                            "duration": "d"})
    sim = Simulation(parse(base))
    sim.run_all()
    big, small = sorted(sim.jobs, key=lambda r: -r.spec.devices)
    assert big.failed is not None and "OpenMesh refused" in big.error and small.finished is not None
    assert sim.jobs_ended() == 2 and sim.all_jobs_done.triggered
    assert sim.env.now == small.finished < 3801.0  # stopped at the last end, not at the horizon
    assert metrics.summarize(sim)["sim_end_s"] == round(small.finished, 6)


def test_validate_says_how_many_rows_make_jobs_and_why_the_others_do_not(base, tmp_path):
    """Rows still running, asking for no device or over max_gpus, or left out by a filter were skipped in silence,
    so a run of a trace could hold far fewer jobs than its file without a word."""
    rows = ("t,n,d,vc\n"
            "0,1,10,a\n"  # a job
            "1,1,,a\n"  # still running
            "2,0,10,a\n"  # no device
            "3,9,10,a\n"  # over max_gpus
            "4,1,0,a\n"  # no time
            "5,1,10,b\n"  # filtered out
            "6,2,10,a\n"  # a job
            "7,1,,a\n")  # still running
    csv_trace(base, tmp_path / "t.csv", rows, columns={"submit": "t", "num_gpu": "n", "duration": "d"},
              max_gpus=8, filter={"column": "vc", "values": ["a"]}, limit=1)
    sc = parse(base)
    assert warnings(sc, generate(sc)) == [
        "note: workload.trace: 2 of 8 rows of t.csv make jobs; skipped: 2 with no duration or end (still running "
        "when the trace ended), 1 asking for 0 devices (zero_gpu: one runs them on one), 1 over max_gpus, 1 with a "
        "duration of 0 or less, 1 left out by the filter; 1 job after partition, every and limit"]
    csv_trace(base, tmp_path / "t.csv", "t,n,d\n0,1,10\n", columns={"submit": "t", "num_gpu": "n", "duration": "d"})
    sc = parse(base)
    assert warnings(sc, generate(sc)) == []  # every row a job: nothing to say


def test_filter_and_partition_values_written_as_numbers_match_the_csvs_cells(base, tmp_path):
    """`values: [1]` for a numeric column was refused ('Input should be a valid string (got 1)'), and a quota keyed
    by a number too ('partition.quotas.1.[key]'); cells are text, so the number is taken as its text."""
    rows = "t,n,d,vc\n0,1,10,1\n1,2,10,2\n2,1,10,1\n"
    csv_trace(base, tmp_path / "t.csv", rows, columns={"submit": "t", "num_gpu": "n", "duration": "d"},
              filter={"column": "vc", "values": [1]})
    assert [j.id for j in generate(parse(base))] == ["row2", "row4"]
    csv_trace(base, tmp_path / "t.csv", rows, columns={"submit": "t", "num_gpu": "n", "duration": "d"},
              partition={"column": "vc", "quotas": {1: 1, 2: 1}})
    assert [(j.id, j.group) for j in generate(parse(base))] == [("row2", "1"), ("row3", "2")]


def test_faults_and_elastic_events_after_the_runs_end_are_warned_about(base):
    """A fault at 100,000 s in a run that ends near 150 s never happened, and nothing said so (0/0 injected)."""
    base["faults"] = [{"kind": "worker_failure", "at": 100_000}, {"kind": "worker_failure", "at": 5}]
    base["elastic"] = [{"at": 100_000, "action": "remove_nodes", "count": 1}]
    sc = parse(base)
    (line,) = warnings(sc, generate(sc))
    assert line.startswith("warning: faults.0, elastic.0: at or after the run's expected end (")
    assert line.endswith(" s): it may never happen")
    base["duration_s"] = 50.0
    sc = parse(base)
    assert warnings(sc, generate(sc)) == ["warning: faults.0, elastic.0: at or after the run's duration_s (50 s): it "
                                          "may never happen"]


def test_a_device_type_no_node_has_is_warned_about(base):
    """A device type declared and given to no node (a typo in a node group's device_type, or one left over) validated
    ok in silence: no job can run on it, and its memory_gb, the smallest, still capped every job's state."""
    base["cluster"]["device_types"]["v100"] = {"speed": 0.5, "memory_gb": 16}
    base["workload"]["state_gb"] = 40
    sc = parse(base)
    assert warnings(sc, generate(sc)) == [
        "warning: cluster.device_types: 'v100' is declared but no node has it (cluster.nodes, node_list, elastic adds, "
        "autoscaler): no job can run there (nodes have 'a100'); the memory_gb of 'v100' (16) still caps every job's "
        "state_gb"]
    assert {j.state_gb for j in generate(sc)} == {16.0}
    base["cluster"]["device_types"]["h100"] = {"memory_gb": 80}
    base["cluster"]["device_types"].pop("v100")
    sc = parse(base)
    assert warnings(sc, generate(sc)) == [
        "warning: cluster.device_types: 'h100' is declared but no node has it (cluster.nodes, node_list, elastic adds, "
        "autoscaler): no job can run there (nodes have 'a100')"]
    base["elastic"] = [{"at": 1, "action": "add_nodes", "add": {"count": 1, "device_type": "h100"}}]
    sc = parse(base)
    assert warnings(sc, generate(sc)) == []  # nodes that join later have it
