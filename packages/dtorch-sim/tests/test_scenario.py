import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
    assert sc.trace_path().resolve() == Path("/work/shared/traces/msft-itp-cluster04.csv").resolve() or \
        sc.trace_path().exists()
    data = yaml.safe_load((REPO / "scenarios" / "itp-cluster04.yaml").read_text())
    data["workload"]["trace"]["path"] = "../shared/traces/msft-itp-cluster04.csv"  # relative to the repo root
    monkeypatch.chdir(REPO)
    assert parse(data, base_dir=str(tmp_path)).trace_path().exists()
