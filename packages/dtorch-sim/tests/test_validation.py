"""One negative test per scenario validation message, and the valid edge next to each rule.

Each rule of `dtorch_sim.scenario` (and the CSV checks of `dtorch_sim.jobs`) is broken alone in an otherwise
valid scenario, and exactly its line must come back: a rule that is switched off, or that fires for the wrong
field, fails here. `test_every_message_has_a_case` reads the source for the messages it raises, so a new rule
without a case here fails too.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable
from pathlib import Path

import pytest

from dtorch_sim import jobs, scenario
from dtorch_sim.scenario import ScenarioError, load, override, parse

Edit = Callable[[dict, Path], object]


def _set(path: str, value: object) -> Edit:
    """An edit that sets `a.b.0.c` to `value` in the scenario data."""

    def edit(data: dict, tmp: Path) -> None:
        *keys, last = path.split(".")
        node = data
        for key in keys:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        node[int(last) if isinstance(node, list) else last] = value

    return edit


def _faults(*faults: dict) -> Edit:
    return _set("faults", list(faults))


def _csv(name: str, text: str, path: str, value: dict | None = None) -> Edit:
    """Write a CSV into the test's folder and point `path` at it (with the other fields of `value`)."""

    def edit(data: dict, tmp: Path) -> None:
        (tmp / name).write_text(text)
        _set(path, {**(value or {}), "path": str(tmp / name)})(data, tmp)

    return edit


def _bytes(name: str, data: bytes, value: dict) -> Edit:
    """Write a trace of these bytes into the test's folder and point workload.trace at it."""

    def edit(data_: dict, tmp: Path) -> None:
        (tmp / name).write_bytes(data)
        data_["workload"]["trace"] = {**value, "path": str(tmp / name)}

    return edit


TRACE = {"format": "itp"}
ITP_ROWS = "job_id,submission_time,duration,num_gpu\na,0,10,1\n"

# rule -> (edit that breaks only it, the one line expected back; "{tmp}" stands for the test's folder)
CASES: dict[str, tuple[Edit, str]] = {
    # pydantic's own field checks, rendered by format_errors
    "missing field": (lambda d, t: d["workload"]["synthetic"].pop("jobs"),
                      "workload.synthetic.jobs: required field is missing"),
    "unknown field": (_set("cost.speed", 2), "cost.speed: unknown field (check the spelling)"),
    "bad value names the input": (_set("seed", "x"), "seed: Input should be a valid integer, unable to parse string "
                                                     "as an integer (got 'x')"),
    # a number is finite: an infinite memory crashed the run, an infinite launch time ran 2.7 million events of nonsense
    "infinite number": (_set("cluster.device_types.a100.memory_gb", float("inf")),
                        "cluster.device_types.a100.memory_gb: Input should be a finite number (got inf)"),
    "not a number": (_set("cost.launch_s", float("nan")), "cost.launch_s: Input should be a finite number (got nan)"),
    "a key not taken": (_set("workload.priorities", {"urgent": 1}),  # was 'workload.priorities.urgent.[key]: ...'
                        "workload.priorities: key 'urgent': Input should be 'high', 'normal' or 'low'"),
    "not a mapping": (lambda d, t: "x", "(top level): expected a mapping of scenario fields, got str"),
    # cluster
    # absurd sizes: they ran out of memory, or built workers for minutes before printing anything
    "too many devices": (_set("cluster.nodes.0.count", 10**9),
                         "cluster: 4,000,000,000 devices at most (the cluster, elastic adds and the autoscaler's "
                         "max_nodes) is over the 100,000 a simulation runs"),
    "too many devices later": (_set("autoscaler", {"node": {"count": 1, "device_type": "a100"}, "max_nodes": 12_500}),
                               "cluster: 100,008 devices at most (the cluster, elastic adds and the autoscaler's "
                               "max_nodes) is over the 100,000 a simulation runs"),
    "too many jobs": (_set("workload.synthetic.jobs", 10**8), "workload.synthetic.jobs: Input should be less than or "
                                                              "equal to 1000000 (got 100000000)"),
    "heartbeat too often": (_set("heartbeat", {"interval_s": 1e-6, "timeout_s": 1e-5}),  # ran forever
                            "heartbeat.interval_s: Input should be greater than or equal to 0.01 (got 1e-06)"),
    "retries too often": (_set("workload.retry_s", 1e-9), "workload.retry_s: Input should be greater than or equal "
                                                          "to 1 (got 1e-09)"),
    "steps": (_set("workload.steps_per_job", 10**7), "workload.steps_per_job: Input should be less than or equal to "
                                                    "100000 (got 10000000)"),
    "failures too often": (_faults({"kind": "worker_failure", "mtbf_s": 1e-6}),
                           "faults.0.mtbf_s: Input should be greater than or equal to 1 (got 1e-06)"),
    "autoscaler too often": (_set("autoscaler", {"node": {"count": 1, "device_type": "a100"}, "max_nodes": 1,
                                                 "check_interval_s": 1e-6}),
                             "autoscaler.check_interval_s: Input should be greater than or equal to 1 (got 1e-06)"),
    "no nodes": (_set("cluster.nodes", []),
                 "cluster: give nodes (a list of node groups) or node_list (a CSV of nodes)"),
    "unknown node type": (_set("cluster.nodes.0.device_type", "h100"),
                          "cluster: node group device_type 'h100' is not one of device_types ['a100', 'slow']"),
    "unknown default type": (_set("cluster.node_list", {"path": "n.csv", "default_device_type": "h100"}),
                             "cluster: node_list.default_device_type 'h100' is not one of device_types "
                             "['a100', 'slow']"),
    "node list missing": (_set("cluster.node_list", {"path": "missing.csv"}),
                          "cluster.node_list.path: file 'missing.csv' not found (looked in . and in the current "
                          "directory)"),
    "node list row": (_csv("n.csv", "sn,gpu,model\nn0,x,a100\n", "cluster.node_list"),
                      "cluster.node_list.path: line 2 of {tmp}/n.csv: devices value 'x' (column 'gpu') is not a whole "
                      "number >= 0"),
    "node list of no devices": (_csv("n.csv", "sn,gpu,model\nn0,0,a100\n", "cluster.node_list"),  # was "ok"
                                "cluster.node_list: no node with devices in {tmp}/n.csv (rows with 0 devices are "
                                "skipped, then every and limit apply)"),
    "node list devices": (_csv("n.csv", "sn,gpu,model\nn0,inf,a100\n", "cluster.node_list"),  # was a traceback
                          "cluster.node_list.path: line 2 of {tmp}/n.csv: devices value 'inf' (column 'gpu') is not a "
                          "whole number >= 0"),
    "node list column": (_csv("n.csv", "sn,gpus,model\nn0,8,a100\n", "cluster.node_list"),
                         "cluster.node_list.columns: column 'gpu' (for devices) is not in the CSV header "
                         "['sn', 'gpus', 'model']"),
    "node list models": (_csv("n.csv", "sn,gpu,model\nn0,8,H800\n", "cluster.node_list"),
                         "cluster.node_list: models ['H800'] are not in cluster.device_types ['a100', 'slow'] (add "
                         "them, or set default_device_type)"),
    # workload
    "distribution parameter": (_set("workload.synthetic.duration", {"dist": "uniform", "low": 1}),
                               "workload.synthetic.duration: a uniform distribution needs high"),
    "uniform order": (_set("workload.synthetic.duration", {"dist": "uniform", "low": 5, "high": 2}),
                      "workload.synthetic.duration: uniform needs low <= high, got low=5.0 high=2.0"),
    "job sizes": (_set("workload.synthetic.size.choices", [1, 2.5]),
                  "workload.synthetic.size.choices: every job size must be a whole number of devices >= 1, or a "
                  "fraction in (0, 1)"),
    "weights count": (_set("workload.synthetic.size.weights", [1, 1]),
                      "workload.synthetic.size: weights must be 3 non-negative numbers, not all zero"),
    "weights sign": (_set("workload.synthetic.size.weights", [1, -1, 1]),
                     "workload.synthetic.size: weights must be 3 non-negative numbers, not all zero"),
    "weights zero": (_set("workload.synthetic.size.weights", [0, 0, 0]),
                     "workload.synthetic.size: weights must be 3 non-negative numbers, not all zero"),
    "two sources": (_set("workload.trace", {**TRACE, "path": "t.csv"}),
                    "workload: give exactly one of workload.synthetic or workload.trace"),
    "no source": (lambda d, t: d["workload"].pop("synthetic"),
                  "workload: give exactly one of workload.synthetic or workload.trace"),
    "priority sign": (_set("workload.priorities", {"high": 1, "low": -1}),
                      "workload: priorities are weights: >= 0, not all 0"),
    "priority zero": (_set("workload.priorities", {"high": 0, "low": 0}),
                      "workload: priorities are weights: >= 0, not all 0"),
    "trace missing": (lambda d, t: d.update(workload={"trace": {**TRACE, "path": "nowhere.csv"}}),
                      "workload.trace.path: file 'nowhere.csv' not found (looked in . and in the current directory)"),
    "trace column": (lambda d, t: (d["workload"].pop("synthetic"),
                                   _csv("t.csv", "id,submission_time,duration,num_gpu\na,0,10,1\n",
                                        "workload.trace", TRACE)(d, t)),
                     "workload.trace.columns: column 'job_id' (for job_id) is not in the CSV header "
                     "['id', 'submission_time', 'duration', 'num_gpu']"),
    "trace row": (lambda d, t: (d["workload"].pop("synthetic"),
                                _csv("t.csv", ITP_ROWS + "b,5,x,2\n", "workload.trace", TRACE)(d, t)),
                  "workload.trace.path: line 3 of {tmp}/t.csv: duration value 'x' (column 'duration') is not a "
                  "finite number"),
    # cells that read as numbers but are none a trace can mean: they made jobs of nan seconds or of -2 devices
    "trace nan": (lambda d, t: (d["workload"].pop("synthetic"),
                                _csv("t.csv", ITP_ROWS + "b,5,nan,2\n", "workload.trace", TRACE)(d, t)),
                  "workload.trace.path: line 3 of {tmp}/t.csv: duration value 'nan' (column 'duration') is not a "
                  "finite number"),
    "trace devices": (lambda d, t: (d["workload"].pop("synthetic"),
                                    _csv("t.csv", ITP_ROWS + "b,5,10,-2\n", "workload.trace", TRACE)(d, t)),
                      "workload.trace.path: line 3 of {tmp}/t.csv: num_gpu value '-2' (column 'num_gpu') is not a "
                      "whole number >= 0"),
    # a negative submit time was dropped in silence (below start_s, 0 by default) while every other bad cell is named
    "trace negative submit": (lambda d, t: (d["workload"].pop("synthetic"),
                                            _csv("t.csv", ITP_ROWS + "b,-5,10,2\n", "workload.trace", TRACE)(d, t)),
                              "workload.trace.path: line 3 of {tmp}/t.csv: submit value '-5' (column "
                              "'submission_time') is before time 0: submit times are seconds >= 0 (dates: 1970 on)"),
    "trace share": (lambda d, t: (d["workload"].pop("synthetic"), _csv(
        "t.csv", "name,num_gpu,gpu_milli,qos,creation_time,scheduled_time,deletion_time\na,1,half,LS,0,1,9\n",
        "workload.trace", {"format": "openb"})(d, t)),
                    "workload.trace.path: line 2 of {tmp}/t.csv: gpu_milli value 'half' (column 'gpu_milli') is not a "
                    "finite number >= 0"),
    "trace duplicate id": (lambda d, t: (d["workload"].pop("synthetic"),
                                         _csv("t.csv", ITP_ROWS + "a,5,10,2\n", "workload.trace", TRACE)(d, t)),
                           "workload.trace.path: line 3 of {tmp}/t.csv: job_id 'a' (column 'job_id') is also on line "
                           "2: job ids must be unique (map job_id to a unique column, or leave it out of a csv trace's "
                           "columns: jobs are then named by their row)"),
    "trace short row": (lambda d, t: (d["workload"].pop("synthetic"),
                                      _csv("t.csv", ITP_ROWS + "b,5,10\n", "workload.trace", TRACE)(d, t)),
                        "workload.trace.path: line 3 of {tmp}/t.csv: 3 fields, the header has 4"),
    # files that are not UTF-8 CSV text were tracebacks (a folder, Latin-1); a spreadsheet's byte-order mark hid the
    # first column (VALID: "trace with a byte-order mark")
    "trace not UTF-8": (lambda d, t: (d["workload"].pop("synthetic"),
                                      _bytes("t.csv", ITP_ROWS.encode() + b"\xe9,1,2,1\n", TRACE)(d, t)),
                        "workload.trace.path: {tmp}/t.csv is not UTF-8 text (byte 0xe9 at offset 49): save it as "
                        "UTF-8"),
    "trace is a folder": (lambda d, t: (d["workload"].pop("synthetic"), (t / "d.csv").mkdir(),
                                        d["workload"].update(trace={**TRACE, "path": str(t / "d.csv")})),
                          "workload.trace.path: cannot read {tmp}/d.csv: Is a directory"),
    "empty node list": (_csv("n.csv", "", "cluster.node_list"),
                        "cluster.node_list.path: {tmp}/n.csv is empty: expected a CSV with a header line"),
    "trace quota": (lambda d, t: (d["workload"].pop("synthetic"), _csv("t.csv", ITP_ROWS, "workload.trace", {
        **TRACE, "partition": {"column": "vc", "quotas": {"a": 0}}})(d, t)),
                    "workload.trace.partition.quotas: a quota is a number of jobs >= 1, got a: 0"),
    "csv columns": (lambda d, t: (d["workload"].pop("synthetic"), _csv("t.csv", ITP_ROWS, "workload.trace", {
        "format": "csv", "columns": {"submit": "submission_time"}})(d, t)),
                    "workload.trace: format csv needs columns for submit, num_gpu, and duration or end: add "
                    "num_gpu, duration or end to workload.trace.columns (role: CSV column name)"),
    "time format": (lambda d, t: (d["workload"].pop("synthetic"), _csv("t.csv", ITP_ROWS, "workload.trace", {
        **TRACE, "time_format": "days"})(d, t)),
                    "workload.trace: time_format must be 'seconds', 'iso' or a strptime pattern such as "
                    "'%Y-%m-%d %H:%M:%S', got 'days'"),
    "no job left": (lambda d, t: (d["workload"].pop("synthetic"), _csv("t.csv", ITP_ROWS, "workload.trace", {
        **TRACE, "filter": {"column": "job_id", "values": ["zz"]}})(d, t)),
                    "workload.trace: no job left to simulate from {tmp}/t.csv (every row was skipped: filter on "
                    "column 'job_id', start_s, zero_gpu, unscheduled, max_gpus, durations <= 0; check them)"),
    "parallel fraction": (_set("workload.scaling", {"parallel_fraction": [0.9, 1.2]}),
                          "workload.scaling.parallel_fraction: a parallel fraction is in (0, 1]: give [low, high] or "
                          "one value, got [0.9, 1.2]"),
    "state size": (_set("workload.state_gb", 0),
                   "workload.state_gb: state_gb is gigabytes > 0 per device, or a distribution, got 0.0"),
    # a number or a distribution: one line about the branch meant (it was a line for each, named by pydantic's types)
    "state size word": (_set("workload.state_gb", "big"), "workload.state_gb: Input should be a valid number, unable "
                                                         "to parse string as a number (got 'big')"),
    "state distribution": (_set("workload.state_gb", {"dist": "pareto"}),
                           "workload.state_gb.dist: Input should be 'constant', 'exponential', 'uniform' or "
                           "'lognormal' (got 'pareto')"),
    # faults
    "fault time": (_faults({"kind": "worker_failure"}), "faults.0: give exactly one of at or mtbf_s"),
    "fault time twice": (_faults({"kind": "worker_failure", "at": 1, "mtbf_s": 5}),
                         "faults.0: give exactly one of at or mtbf_s"),
    "node failure target": (_faults({"kind": "node_failure", "at": 1, "worker": "node0/gpu0"}),
                            "faults.0: a node_failure names a node, not a worker"),
    "two targets": (_faults({"kind": "worker_failure", "at": 1, "worker": "node0/gpu0", "node": "node0"}),
                    "faults.0: name a worker or a node, not both"),
    "timed kind": (_faults({"kind": "worker_failure", "at": 1, "until": 5}),
                   "faults.0: until and duration_s are for slow_worker and partition faults"),
    "timed kind by duration": (_faults({"kind": "node_failure", "at": 1, "duration_s": 5}),
                               "faults.0: until and duration_s are for slow_worker and partition faults"),
    "until and duration": (_faults({"kind": "slow_worker", "at": 1, "until": 5, "duration_s": 2}),
                           "faults.0: give until or duration_s, not both"),
    "until without at": (_faults({"kind": "slow_worker", "mtbf_s": 10, "until": 5}),
                         "faults.0: until needs at, and must be later than at (use duration_s with mtbf_s)"),
    "until not later": (_faults({"kind": "slow_worker", "at": 5, "until": 5}),
                        "faults.0: until needs at, and must be later than at (use duration_s with mtbf_s)"),
    "partition heals": (_faults({"kind": "partition", "at": 5, "worker": "node0/gpu0"}),
                        "faults.0: a partition needs until or duration_s (when it heals)"),
    "repair of a slow worker": (_faults({"kind": "slow_worker", "at": 5, "duration_s": 1, "repair_s": 3}),
                                "faults.0: repair_s is for failures and partitions"),
    # targets no run has: a typo was a fault or removal that never happened, with no word
    "unknown worker": (_faults({"kind": "worker_failure", "at": 1, "worker": "node0/gpu4"}),
                       "faults.0.worker: no worker 'node0/gpu4' in the cluster (workers are named like 'node0/gpu0')"),
    "unknown node": (_faults({"kind": "node_failure", "at": 1, "node": "nod1"}),
                     "faults.0.node: no node 'nod1' in the cluster (nodes are named like 'node0')"),
    "unknown removed node": (_set("elastic", [{"at": 1, "action": "remove_nodes", "nodes": ["node1", "node9"]}]),
                             "elastic.0.nodes: no node 'node9' in the cluster (nodes are named like 'node0')"),
    "removing more nodes than there are": (_set("elastic", [{"at": 1, "action": "remove_nodes", "count": 1000}]),
                                           "elastic.0.count: 1,000 nodes to remove, more than the 2 the run can have"),
    # elasticity and autoscaling
    "add without a group": (_set("elastic", [{"at": 1, "action": "add_nodes"}]),
                            "elastic.0: add_nodes needs `add` (a node group: count, devices_per_node, device_type)"),
    "remove what": (_set("elastic", [{"at": 1, "action": "remove_nodes"}]),
                    "elastic.0: remove_nodes needs `nodes` (names) or `count` (the newest nodes leave)"),
    "autoscaler bounds": (_set("autoscaler", {"node": {"count": 1, "device_type": "a100"}, "max_nodes": 1,
                                              "min_nodes": 2}),
                          "autoscaler: min_nodes (2) must not exceed max_nodes (1)"),
    "heartbeat order": (_set("heartbeat", {"interval_s": 4, "timeout_s": 4}),
                        "heartbeat: timeout_s (4.0) must exceed interval_s (4.0)"),
    # policies
    "unknown policy": (_set("policy", {"name": "srtf"}),
                       "policy.name: unknown policy 'srtf': known policies are dtorch, fifo, las, priority"),
    "policy parameter": (_set("policy", {"name": "fifo", "params": {"pack": True}}),
                         "policy.params: policy 'fifo' takes no parameter 'pack'"),
    "compared policy": (_set("policy", {"name": "fifo", "params_for": {"srtf": {}}}),
                        "policy.params_for.srtf: unknown policy 'srtf': known policies are dtorch, fifo, las, "
                        "priority"),
    "compared policy parameter": (_set("policy", {"name": "fifo", "params_for": {"las": {"thresholds": [5, 1]}}}),
                                  "policy.params_for.las: policy parameter 'thresholds' must be ascending positive "
                                  "device-seconds, got [5, 1]"),
}

# the valid side of each boundary above: these must parse
VALID: dict[str, Edit] = {
    "devices at the limit": _set("autoscaler", {"node": {"count": 1, "devices_per_node": 8, "device_type": "a100"},
                                                "max_nodes": 12_499}),
    "targets that join later": lambda d, t: d.update(
        elastic=[{"at": 1, "action": "add_nodes", "add": {"count": 1, "device_type": "a100", "name": "extra"}},
                 {"at": 9, "action": "remove_nodes", "nodes": ["extra2"]}],
        autoscaler={"node": {"count": 1, "devices_per_node": 2, "device_type": "a100", "name": "auto"}, "max_nodes": 2},
        faults=[{"kind": "worker_failure", "at": 5, "worker": "auto4/gpu1"}, {"kind": "node_failure", "at": 5,
                                                                            "node": "node1"}]),
    "heartbeat and retries at their limits": lambda d, t: d.update(heartbeat={"interval_s": 0.01, "timeout_s": 0.05},
                                                                   workload={**d["workload"], "retry_s": 1}),
    "uniform of one value": _set("workload.synthetic.duration", {"dist": "uniform", "low": 2, "high": 2}),
    "fractional sizes": _set("workload.synthetic.size", {"choices": [0.5, 1, 8], "weights": [0, 0, 1]}),
    "priority weights": _set("workload.priorities", {"high": 0, "low": 1}),
    "node failure by node": _faults({"kind": "node_failure", "mtbf_s": 100, "node": "node1", "repair_s": 0}),
    "worker failure by node": _faults({"kind": "worker_failure", "at": 1, "node": "node1"}),
    "slow worker until": _faults({"kind": "slow_worker", "at": 5, "until": 5.5}),
    "partition for a while": _faults({"kind": "partition", "mtbf_s": 50, "duration_s": 5, "repair_s": 1}),
    "elastic": _set("elastic", [{"at": 1, "action": "remove_nodes", "count": 1},
                                {"at": 2, "action": "add_nodes", "add": {"count": 1, "device_type": "slow"}}]),
    "autoscaler at its bound": _set("autoscaler", {"node": {"count": 1, "device_type": "a100"}, "max_nodes": 1,
                                                   "min_nodes": 1}),
    "heartbeat just in order": _set("heartbeat", {"interval_s": 4, "timeout_s": 4.001}),
    "node list with a default": _csv("n.csv", "sn,gpu,model\nn0,8,H800\nn1,0,H800\n", "cluster.node_list",
                                     {"default_device_type": "slow"}),
    "state distribution": _set("workload.state_gb", {"dist": "uniform", "low": 1, "high": 3}),
    "trace with a byte-order mark": lambda d, t: (d["workload"].pop("synthetic"),
                                                  _bytes("t.csv", b"\xef\xbb\xbf" + ITP_ROWS.encode(), TRACE)(d, t)),
    "trace": lambda d, t: (d["workload"].pop("synthetic"), _csv("t.csv", ITP_ROWS, "workload.trace", TRACE)(d, t)),
}


def _broken(base: dict, tmp: Path, edit: Edit) -> object:
    data = copy.deepcopy(base)
    out = edit(data, tmp)
    return out if isinstance(out, str) else data


@pytest.mark.parametrize("rule", sorted(CASES))
def test_each_rule_alone_gives_its_one_line(rule: str, base: dict, tmp_path: Path) -> None:
    edit, line = CASES[rule]
    with pytest.raises(ScenarioError) as e:
        parse(_broken(base, tmp_path, edit))
    assert e.value.lines == [line.format(tmp=tmp_path)]


@pytest.mark.parametrize("case", sorted(VALID))
def test_the_valid_side_of_each_boundary_parses(case: str, base: dict, tmp_path: Path) -> None:
    parse(_broken(base, tmp_path, VALID[case]))


def test_the_base_scenario_is_valid(base: dict) -> None:
    parse(base)


def test_several_mistakes_give_several_lines_with_the_source(base: dict) -> None:
    base["faults"] = [{"kind": "worker_failure"}, {"kind": "node_failure", "at": 1, "worker": "w"}]
    base["heartbeat"] = {"interval_s": 1, "timeout_s": 1}
    with pytest.raises(ScenarioError) as e:
        parse(base, source="s.yaml")
    assert sorted(e.value.lines) == ["s.yaml: faults.0: give exactly one of at or mtbf_s",
                                     "s.yaml: faults.1: a node_failure names a node, not a worker",
                                     "s.yaml: heartbeat: timeout_s (1.0) must exceed interval_s (1.0)"]
    assert str(e.value) == "\n".join(e.value.lines)


OVERRIDES = [
    ("seed", "--set seed: expected path=value, e.g. cluster.nodes.0.count=48"),
    ("=3", "--set =3: expected path=value, e.g. cluster.nodes.0.count=48"),
    ("seed=[1", "--set seed=[1: the value is not valid YAML: expected ',' or ']', but got '<stream end>'"),
    ("cluster.nodes.5.count=1", "--set cluster.nodes.5.count=1: cluster.nodes has no item '5'"),
    ("seed.x=1", "--set seed.x=1: seed is not a mapping or a list"),
]


@pytest.mark.parametrize("assignment,line", OVERRIDES)
def test_override_mistakes(assignment: str, line: str, base: dict) -> None:
    with pytest.raises(ScenarioError) as e:
        override(base, assignment)
    (got,) = e.value.lines
    assert got.startswith(line), got


def test_overrides_reach_mappings_and_list_items(base: dict) -> None:
    data = override(override(base, "cluster.nodes.0.count=48"), "policy={name: las}")
    assert data["cluster"]["nodes"][0]["count"] == 48 and data["policy"] == {"name": "las"}
    assert parse(data).policy.name == "las"
    data = override(base, "cluster.nodes.0={count: 3, devices_per_node: 2, device_type: slow}")  # a whole item
    assert data["cluster"]["nodes"] == [{"count": 3, "devices_per_node": 2, "device_type": "slow"}]
    assert parse(data).cluster.nodes[0].count == 3


def test_trace_roles_and_priorities(base: dict, tmp_path: Path) -> None:
    """A csv trace needs an end or a duration (either will do); openb traces map its priority classes by default,
    others keep priorities as they are unless a priority_map says otherwise."""
    base["workload"].pop("synthetic")
    for column in ("end", "duration"):
        _csv("t.csv", f"submit,gpus,{column}\n0,1,10\n", "workload.trace",
             {"format": "csv", "columns": {"submit": "submit", "num_gpu": "gpus", column: column}})(base, tmp_path)
        assert parse(base).workload.trace.columns[column] == column
    _csv("t.csv", ITP_ROWS, "workload.trace", TRACE)(base, tmp_path)
    assert parse(base).workload.trace.priorities() == {}
    assert scenario.Trace(format="openb", path="x").priorities() == {"LS": "high", "Guaranteed": "high",
                                                                      "Burstable": "normal", "BE": "low"}


def test_an_openb_trace_is_read_by_its_own_column_names_and_qos_classes(tmp_path: Path) -> None:
    """openb's pod list (Alibaba's GPU-sharing trace) needs no column map: name, creation/scheduled/deletion times,
    num_gpu, gpu_milli and the qos class (LS and Guaranteed high, Burstable normal, BE low) by default."""
    pods = tmp_path / "pods.csv"
    pods.write_text("name,num_gpu,gpu_milli,qos,creation_time,scheduled_time,deletion_time\n"
                    "a,1,1000,LS,0,10,110\nb,2,1000,Guaranteed,5,7,50\nc,1,1000,Burstable,20,25,300\n"
                    "d,4,1000,BE,30,30,90\n")
    sc = parse({"cluster": {"device_types": {"a100": {}},
                            "nodes": [{"count": 1, "devices_per_node": 8, "device_type": "a100"}]},
                "workload": {"trace": {"format": "openb", "path": str(pods)}}})
    assert [(j.id, j.arrival, j.devices, j.priority, j.duration) for j in jobs.generate(sc)] == [
        ("a", 0.0, 1, "high", 100.0), ("b", 5.0, 2, "high", 43.0), ("c", 20.0, 1, "normal", 275.0),
        ("d", 30.0, 4, "low", 60.0)]


def test_load_mistakes(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError) as e:
        load(tmp_path / "none.yaml")
    assert e.value.lines == [f"{tmp_path / 'none.yaml'}: cannot read: No such file or directory"]
    (tmp_path / "bad.yaml").write_text("a: [1\n")
    with pytest.raises(ScenarioError) as e:
        load(tmp_path / "bad.yaml")
    assert e.value.lines == [f"{tmp_path / 'bad.yaml'}: line 2 not valid YAML: expected ',' or ']', but got "
                             "'<stream end>'"]  # where, and yaml's own words for what is wrong
    (tmp_path / "latin1.yaml").write_bytes("name: caf\u00e9\n".encode("latin-1"))  # was a UnicodeDecodeError traceback
    with pytest.raises(ScenarioError) as e:
        load(tmp_path / "latin1.yaml")
    assert e.value.lines == [f"{tmp_path / 'latin1.yaml'}: cannot read: not UTF-8 text (byte 0xe9 at offset 9)"]


def _messages(module: object) -> list[str]:
    """The literal text of every message raised in `module` (f-strings: their longest literal part)."""
    tree = ast.parse(Path(module.__file__).read_text())  # type: ignore[attr-defined]
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
            continue
        for arg in ast.walk(node.exc):
            parts = [arg.value] if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else \
                [v.value for v in arg.values if isinstance(v, ast.Constant)] if isinstance(arg, ast.JoinedStr) else []
            if parts:
                found.append(max(parts, key=len).strip(" :"))
                break
    return [text for text in found if len(text) > 3]


def test_every_message_has_a_case() -> None:
    covered = "\n".join([line for _, line in CASES.values()] + [line for _, line in OVERRIDES] +
                        ["cannot read: not UTF-8 text (byte", "not valid YAML"])  # test_load_mistakes
    for module in (scenario, jobs):
        missing = [text for text in _messages(module) if text not in covered]
        assert not missing, f"{module.__name__} raises messages no case here triggers: {missing}"
