import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dtorch_sim.jobs import generate
from dtorch_sim.scenario import ScenarioError, load, parse

REPO = Path(__file__).resolve().parents[3]


def errors(data: dict) -> list[str]:
    with pytest.raises(ScenarioError) as e:
        parse(data)
    return e.value.lines


def test_errors_name_the_field_path(base):
    base["cluster"]["nodes"][0]["count"] = 0
    base["workload"]["synthetic"]["arrival"]["rate_per_s"] = "fast"
    base["heartbeat"]["intervall_s"] = 1
    del base["workload"]["synthetic"]["duration"]
    lines = errors(base)
    assert len(lines) == 4
    assert any(ln.startswith("cluster.nodes.0.count: ") and "greater than or equal to 1" in ln for ln in lines)
    assert any(ln.startswith("workload.synthetic.arrival.rate_per_s: ") and "'fast'" in ln for ln in lines)
    assert "heartbeat.intervall_s: unknown field (check the spelling)" in lines
    assert "workload.synthetic.duration: required field is missing" in lines


def test_cross_field_mistakes(base):
    base["cluster"]["nodes"][0]["device_type"] = "h100"
    base["heartbeat"] = {"interval_s": 5, "timeout_s": 2}
    base["faults"] = [{"kind": "worker_failure"}]
    lines = errors(base)
    assert any(ln.startswith("cluster: ") and "'h100'" in ln for ln in lines)
    assert any(ln.startswith("heartbeat: ") and "must exceed" in ln for ln in lines)
    assert "faults.0: give exactly one of at or mtbf_s" in lines


def test_unknown_policy_and_missing_trace(base):
    base["policy"] = {"name": "srtf"}
    assert errors(base) == ["policy.name: unknown policy 'srtf': known policies are dtorch, fifo, las, priority"]
    base["policy"] = {"name": "las", "params": {"thresholds": [600, 60]}}
    assert errors(base) == ["policy.params: policy parameter 'thresholds' must be ascending positive device-seconds, "
                            "got [600, 60]"]
    base["policy"] = {"name": "fifo", "params": {"pack": True}}
    assert errors(base) == ["policy.params: policy 'fifo' takes no parameter 'pack'"]
    base["policy"] = {"name": "fifo"}
    base["workload"] = {"trace": {"format": "itp", "path": "nowhere.csv"}}
    assert errors(base)[0].startswith("workload.trace.path: file 'nowhere.csv' not found")


def test_cli_validate_one_line_per_error_no_traceback(tmp_path, base):
    base["cluster"]["nodes"][0]["count"] = -1
    base["seed"] = "x"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(base))
    out = subprocess.run([sys.executable, "-m", "dtorch_sim", "validate", str(path)], capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith(f"{path}: ") for ln in lines)
    assert any("cluster.nodes.0.count" in ln for ln in lines) and any(": seed: " in ln for ln in lines)
    path.write_text("cluster: [unclosed\n")
    out = subprocess.run([sys.executable, "-m", "dtorch_sim", "validate", str(path)], capture_output=True, text=True)
    assert out.returncode == 1 and "not valid YAML" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "scenarios").glob("*.yaml")))
def test_shipped_scenarios_validate(name):
    load(REPO / "scenarios" / name)  # trace paths resolve against the scenario file's folder


def test_trace_paths_resolve_against_the_scenario_file_then_cwd(tmp_path, monkeypatch):
    sc = load(REPO / "scenarios" / "itp-cluster04.yaml")
    assert sc.trace_path().resolve() == (REPO / "scenarios" / "traces" / "msft-itp-cluster04.csv").resolve()
    data = yaml.safe_load((REPO / "scenarios" / "itp-cluster04.yaml").read_text())
    data["workload"]["trace"]["path"] = "scenarios/traces/msft-itp-cluster04.csv"  # relative to the repo root
    monkeypatch.chdir(REPO)
    assert parse(data, base_dir=str(tmp_path)).trace_path().exists()


def test_new_sections_are_validated_with_field_paths(base):
    base["faults"] = [{"kind": "partition", "at": 5, "worker": "node0/gpu0"},
                      {"kind": "slow_worker", "at": 5, "repair_s": 3}]
    base["autoscaler"] = {"node": {"count": 1, "device_type": "a100"}, "max_nodes": 1, "min_nodes": 2}
    base["elastic"] = [{"at": 1, "action": "remove_nodes", "mode": "unplug", "count": 1}]
    base["recovery"] = {"snapshot_every_batches": -1}
    base["workload"]["synthetic"]["size"] = {"choices": [1.5]}
    lines = errors(base)
    assert "faults.0: a partition needs until or duration_s (when it heals)" in lines
    assert "faults.1: repair_s is for failures and partitions" in lines
    assert "autoscaler: min_nodes (2) must not exceed max_nodes (1)" in lines
    assert any(ln.startswith("elastic.0.mode: ") and "'drain' or 'kill'" in ln for ln in lines)
    assert any(ln.startswith("recovery.snapshot_every_batches: ") for ln in lines)
    assert any(ln.startswith("workload.synthetic.size.choices: ") and "fraction in (0, 1)" in ln for ln in lines)
    assert len(lines) == 6


def test_trace_columns_and_node_lists_are_checked_against_the_csv(base, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("id,t,len,gpus\na,0,10,1\nb,5,x,2\n")
    base["workload"] = {"trace": {"format": "itp", "path": str(trace)}}
    assert errors(base) == ["workload.trace.columns: column 'job_id' (for job_id) is not in the CSV header "
                            "['id', 't', 'len', 'gpus']"]
    base["workload"]["trace"]["columns"] = {"job_id": "id", "submit": "t", "duration": "len", "num_gpu": "gpus"}
    (line,) = errors(base)
    assert line.startswith("workload.trace.path: line 3 of ") and line.endswith(
        ": duration value 'x' (column 'len') is not a finite number")
    trace.write_text("id,t,len,gpus\na,0,10,1\nb,5,7,2\n")
    assert [(j.id, j.devices) for j in generate(parse(base))] == [("a", 1), ("b", 2)]
    nodes = tmp_path / "n.csv"
    nodes.write_text("sn,gpu,model\nn0,8,H800\n")
    base["cluster"] = {"device_types": {"a100": {}}, "node_list": {"path": str(nodes)}}
    assert errors(base) == ["cluster.node_list: models ['H800'] are not in cluster.device_types ['a100'] (add them, "
                            "or set default_device_type)"]
    base["cluster"]["node_list"]["path"] = "missing.csv"
    assert errors(base)[0].startswith("cluster.node_list.path: file 'missing.csv' not found")


def test_compare_params_for_unknown_policies_are_reported(base):
    base["policy"] = {"name": "fifo", "params_for": {"srtf": {}, "las": {"thresholds": [5, 1]}}}
    assert errors(base) == [
        "policy.params_for.srtf: unknown policy 'srtf': known policies are dtorch, fifo, las, priority",
        "policy.params_for.las: policy parameter 'thresholds' must be ascending positive device-seconds, got [5, 1]"]


def test_cost_model_settings_are_checked(base):
    base["workload"]["scaling"] = {"model": "amdahl", "parallel_fraction": [0.99, 0.5]}
    base["workload"]["state_gb"] = 0
    assert sorted(errors(base)) == [
        "workload.scaling.parallel_fraction: a parallel fraction is in (0, 1]: give [low, high] or one value, got "
        "[0.99, 0.5]",
        "workload.state_gb: state_gb is gigabytes > 0 per device, or a distribution, got 0.0"]
    base["workload"]["scaling"] = {"parallel_fraction": [1.5]}
    base["workload"]["state_gb"] = {"dist": "uniform", "low": 1, "high": 8}
    assert errors(base) == ["workload.scaling.parallel_fraction: a parallel fraction is in (0, 1]: give [low, high] "
                            "or one value, got [1.5]"]
    base["workload"]["scaling"] = {"parallel_fraction": [0.9, 1.0]}
    jobs = generate(parse(base))
    assert all(0.9 <= j.parallel <= 1.0 and 1 <= j.state_gb <= 8 for j in jobs) and len({j.parallel for j in jobs}) > 1


def test_declared_steps_and_elastic_jobs_are_checked_and_drawn(base):
    base["workload"]["expected_steps"] = {"share": 1.5, "error": -1}
    base["workload"]["elastic_jobs"] = {"share": 0.5, "min_fraction": 0}
    assert sorted(errors(base)) == [
        "workload.elastic_jobs.min_fraction: Input should be greater than 0 (got 0)",
        "workload.expected_steps.error: Input should be greater than or equal to 0 (got -1)",
        "workload.expected_steps.share: Input should be less than or equal to 1 (got 1.5)"]
    base["workload"]["expected_steps"] = {"share": 0.5}
    base["workload"]["elastic_jobs"] = {"share": 1.0, "min_fraction": 0.5}
    base["workload"]["synthetic"]["jobs"] = 40
    jobs = generate(parse(base))
    assert 5 < sum(j.declares > 0 for j in jobs) < 35 and all(j.declares in (0, 1) for j in jobs)  # error 0
    assert all(j.min_devices == (j.devices + 1) // 2 if j.devices > 1 else j.min_devices == 0 for j in jobs)
