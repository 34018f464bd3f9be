"""What a valid scenario means: the distributions draw what they say (their means, their ranges), each policy
gets its own parameters, another policy's run changes only the policy, and CSV paths resolve where the docs say."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

import pytest

from dtorch_sim.scenario import Distribution, Policy, ScenarioError, parse

N = 20_000


def _draws(dist: Distribution, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [dist.sample(rng) for _ in range(N)]


@pytest.mark.parametrize("dist, mean", [
    (Distribution(dist="exponential", mean=30.0), 30.0),
    (Distribution(dist="lognormal", mean=30.0, sigma=0.8), 30.0),  # `mean` is the mean of the values drawn
    (Distribution(dist="lognormal", mean=5.0), 5.0),
    (Distribution(dist="uniform", low=10.0, high=20.0), 15.0),
])
def test_a_distribution_draws_around_its_mean(dist, mean):
    draws = _draws(dist)
    assert abs(statistics.fmean(draws) - mean) < 0.04 * mean
    assert all(d > 0 for d in draws)
    assert len(set(draws)) > N // 2  # random, not one value


def test_the_spread_of_each_distribution():
    uniform = _draws(Distribution(dist="uniform", low=10.0, high=20.0))
    assert 10.0 <= min(uniform) < 10.01 and 19.99 < max(uniform) <= 20.0
    narrow, wide = (_draws(Distribution(dist="lognormal", mean=5.0, sigma=s)) for s in (0.1, 1.0))
    assert statistics.stdev(narrow) < 0.15 * 5.0 < statistics.stdev(wide)
    logs = [math.log(x) for x in wide]
    assert abs(statistics.stdev(logs) - 1.0) < 0.03  # sigma is the spread of the underlying normal
    exponential = _draws(Distribution(dist="exponential", mean=30.0))
    assert abs(statistics.stdev(exponential) - 30.0) < 0.05 * 30.0  # an exponential's stdev is its mean


def test_a_constant_is_its_value_and_a_point_range_is_its_point():
    rng = random.Random(0)
    assert {Distribution(dist="constant", value=7.5).sample(rng) for _ in range(5)} == {7.5}
    assert {Distribution(dist="uniform", low=3.0, high=3.0).sample(rng) for _ in range(5)} == {3.0}


def test_draws_depend_only_on_the_seed():
    dist = Distribution(dist="lognormal", mean=5.0)
    assert _draws(dist, seed=3)[:50] == _draws(dist, seed=3)[:50] != _draws(dist, seed=4)[:50]


def test_each_policy_gets_its_own_parameters():
    policy = Policy(name="las", params={"quantum_s": 5}, params_for={"dtorch": {"preempt": False}, "las": {"q": 1}})
    assert policy.for_name("dtorch") == {"preempt": False}
    assert policy.for_name("las") == {"q": 1}  # params_for wins over params, even for the policy's own name
    assert policy.for_name("fifo") == {}  # another policy does not inherit this one's parameters
    assert Policy(name="las", params={"quantum_s": 5}).for_name("las") == {"quantum_s": 5}
    policy.for_name("dtorch")["preempt"] = True  # a copy: the scenario is not changed by its user
    assert policy.params_for["dtorch"] == {"preempt": False}


def test_run_and_compare_give_the_scenarios_policy_the_same_parameters(base):
    """`run` builds the scenario's own policy with `for_name` too: its `params_for` entry is not ignored."""
    from dtorch_sim.harness import Simulation

    base["policy"] = {"name": "las", "params_for": {"las": {"thresholds": [7, 70]}}}
    sc = parse(base)
    own = Simulation(sc).core.policy.thresholds
    assert own == Simulation(sc.with_policy("las")).core.policy.thresholds == (7.0, 70.0)


def test_another_policys_run_changes_only_the_policy(base):
    base["policy"] = {"name": "las", "params": {"starve_factor": 5}, "params_for": {"priority": {"pack": False}}}
    sc = parse(base)
    other = sc.with_policy("priority")
    assert (other.policy.name, other.policy.params) == ("priority", {"pack": False})
    assert other.policy.params_for == sc.policy.params_for
    assert other.model_dump(exclude={"policy"}) == sc.model_dump(exclude={"policy"})
    assert (sc.policy.name, sc.policy.params) == ("las", {"starve_factor": 5})  # the original is unchanged
    assert sc.with_policy("fifo").policy.params == {}


def test_a_csv_path_resolves_against_the_scenario_folder_then_the_current_one(base, tmp_path, monkeypatch):
    folder, cwd = tmp_path / "scenarios", tmp_path / "cwd"
    folder.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    sc = parse(base, base_dir=str(folder))
    (folder / "both.csv").write_text("")
    (cwd / "both.csv").write_text("")
    (cwd / "here.csv").write_text("")
    assert sc.resolve("both.csv") == folder / "both.csv"  # the scenario's folder first
    assert sc.resolve("here.csv") == Path("here.csv")  # else the current directory
    assert sc.resolve("nowhere.csv") == folder / "nowhere.csv"  # neither: named as the scenario's own
    assert sc.resolve(str(cwd / "here.csv")) == cwd / "here.csv"
    monkeypatch.setenv("HOME", str(cwd))
    assert sc.resolve(str(Path("~", "here.csv"))) == cwd / "here.csv"  # the user's home folder, expanded


def test_a_scenario_with_no_policy_runs_the_controllers_default(base):
    """A user pointing the simulator at a trace to see what DTorch would do got FIFO, which the controller runs only
    when told (its default is the DTorch policy)."""
    from dtorch_controller.core.policies import DEFAULT_POLICY

    del base["policy"]
    assert parse(base).policy.name == DEFAULT_POLICY == "dtorch"


def test_a_cluster_of_one_device_type_need_not_name_it(base):
    """`nodes: [{count: 4, devices_per_node: 8}]` was refused ("cluster.device_types: required field is missing",
    "cluster.nodes.0.device_type: required field is missing"): one device type, `gpu`, is the default, and a node
    group takes the only type there is."""
    base["cluster"] = {"nodes": [{"count": 4, "devices_per_node": 8}]}
    cluster = parse(base).cluster
    assert list(cluster.device_types) == ["gpu"] and cluster.nodes[0].device_type == "gpu"
    assert (cluster.device_types["gpu"].speed, cluster.device_types["gpu"].memory_gb) == (1.0, 80.0)
    base["cluster"] = {"device_types": {"h100": {"speed": 2.0}}, "nodes": [{"count": 1}]}
    assert parse(base).cluster.nodes[0].device_type == "h100"
    base["cluster"] = {"device_types": {"h100": {}, "a100": {}}, "nodes": [{"count": 1}]}
    with pytest.raises(ScenarioError, match="cluster.nodes.0.device_type"):  # two types: the group must say which
        parse(base)
