"""Worker faults with real processes: a small tensor-parallel MLP trained with AdamW keeps its exact losses
and weights through SIGKILL, SIGSTOP, a drain and a migration of a worker mid-run; losing every copy is
one clear error; a paused worker is declared lost within the heartbeat timeout and exits when it wakes.

Each training test runs integration/_fault_run.py in a subprocess (its own embedded cluster: a
controller and worker processes), which trains once without a fault and once with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import CONTROLLER, Keys, run_scenario, start_controller, start_worker, stop_all

HERE = Path(__file__).parent
SNAPSHOTS = {"DTORCH_SNAPSHOT_BATCHES": "4"}  # a few snapshots per run: both copies and the replayed log are used
ENV = {k: v for k, v in os.environ.items() if k != "DTORCH_CONTROLLER"} | SNAPSHOTS


def run(mode: str, *args: str, timeout: float = 240) -> dict:
    return run_scenario("_fault_run.py", mode, *args, env=SNAPSHOTS, timeout=timeout)


def assert_same_as_fault_free(result: dict) -> None:
    info = result["info"]
    assert info["error"] is None, info["error"]
    (clean_losses, clean_weights), (losses, weights) = result["clean"], result["run"]
    assert len(losses) == len(clean_losses) == 10
    assert losses == clean_losses  # bit for bit: replay runs the same ops on the same values
    assert weights == clean_weights


def test_sigkill_mid_training_is_rebuilt_and_the_results_equal_the_fault_free_run():
    result = run("kill")
    assert_same_as_fault_free(result)
    info = result["info"]
    assert info["workers"][info["victim"]] == "lost"
    assert info["victim"] not in info["devices"].values()  # its logical device runs elsewhere now
    assert any("recovered in" in line for line in info["events"]), info["events"]


def test_a_graph_step_goes_on_as_a_graph_through_a_sigkill_with_the_fault_free_results():
    """The graph's replays after the rebuild are translated for the new binding (never a stale program)."""
    result = run("kill", "--graph")
    assert_same_as_fault_free(result)
    info = result["info"]
    assert info["graphed"] == 7  # steps 4-10: 1 warms up, 2 is recorded, 3 verifies; the kill is after step 5
    assert info["workers"][info["victim"]] == "lost" and info["victim"] not in info["devices"].values()


def test_sigkill_in_the_middle_of_an_all_reduce_neither_hangs_the_survivors_nor_changes_the_results():
    """The tensor-parallel all-reduces run on gloo groups: the survivors are waiting in one for the (stopped)
    victim when it is killed; their op fails (connection closed), the rebuild aborts the groups and replays."""
    result = run("kill_in_collective")
    assert_same_as_fault_free(result)
    info = result["info"]
    assert any("all_reduce" in line and ("by peer" in line or "aborted" in line)
               for line in info["worker_warnings"]), info["worker_warnings"]  # it was in flight, and it ended
    assert info["workers"][info["victim"]] == "lost"
    assert info["victim"] not in info["devices"].values()
    assert any("recovered in" in line for line in info["events"]), info["events"]


def test_uploads_only_the_killed_worker_had_are_asked_of_the_client_again_and_the_results_stay_exact():
    """The step's sharded inputs reached the victim, which is killed before it made their copies for recovery: no
    copy and no replica holds its shards, so the rebuild asks the client, which still keeps them, to upload them
    again (before: the session could not be rebuilt, and lost them)."""
    result = run("kill_after_upload")
    assert_same_as_fault_free(result)
    info = result["info"]
    assert info["workers"][info["victim"]] == "lost" and info["victim"] not in info["devices"].values()
    assert any("asks its client for" in line for line in info["events"]), info["events"]
    assert any("recovered in" in line for line in info["events"]), info["events"]


def test_a_sigstopped_worker_is_treated_the_same_and_exits_when_it_wakes():
    result = run("stop")
    assert_same_as_fault_free(result)
    info = result["info"]
    assert info["workers"][info["victim"]] == "lost"
    assert info["exit_code"] == 3  # fenced: its late report was refused
    assert any("recovered in" in line for line in info["events"])


def test_drain_during_training_loses_nothing_and_releases_the_worker():
    result = run("drain")
    assert_same_as_fault_free(result)
    info = result["info"]
    assert info["admin_error"] is None and info["admin"]["ok"], info
    (move,) = info["admin"]["moves"]
    assert move["from"] == info["victim"] and move["devices"] == [1] and move["bytes"] > 0
    assert info["workers"][info["victim"]] == "lost"  # released: fenced, it exits
    assert any("released after draining" in line for line in info["events"])


def test_migrating_a_logical_device_during_training_keeps_results_and_reports_the_downtime():
    result = run("migrate", "--workers", "4")
    assert_same_as_fault_free(result)
    info = result["info"]
    assert info["admin_error"] is None and info["admin"]["ok"], info
    (move,) = info["admin"]["moves"]
    assert (move["from"], move["to"], move["devices"]) == (info["from"], info["to"], [1])
    assert move["bytes"] > 0 and 0 < move["downtime_s"] < 10
    assert info["devices"]["1"] == info["to"]
    assert any("downtime" in line for line in info["events"])


def test_losing_every_copy_is_one_clear_error_naming_the_lost_tensors_and_their_ops():
    result = run("kill2")
    error = result["info"]["error"]
    assert error.startswith("ClusterError: ") and "\n" not in error
    assert "tensors lost: tensor" in error and "(made by aten." in error and "_fault_run.py:" in error
    assert "not rebuilt: every copy" in error
    assert result["info"]["workers"]["w2"] == "alive"  # the controller and the other workers carry on


# ---------------------------------------------------------------- processes started with the CLIs


# The controller and workers get a session of their own, so that signals sent to the test run (Ctrl-C) do not
# reach them and only the fixture's teardown stops them.
_DETACHED = {"stdin": subprocess.DEVNULL, "start_new_session": True}


def _cli(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CONTROLLER, *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture
def cli_cluster(tmp_path):
    """A controller and 4 workers started with their CLIs, as an operator would."""
    keys = Keys.make(tmp_path)
    env = {**ENV, "DTORCH_KEYS": str(keys.path), "DTORCH_API_KEY": keys.admin}  # the operator's (and client's)
    deadline = time.monotonic() + 60  # one bound for the controller, the workers registering and their logs
    controller, address = start_controller(tmp_path / "addr", env, log=tmp_path / "controller.log",
                                           limit=deadline - time.monotonic(), **_DETACHED)
    procs = [controller]
    try:
        env["DTORCH_CONTROLLER"] = address
        for i in range(4):
            procs.append(start_worker(address, {**env, "DTORCH_API_KEY": keys.worker}, log=tmp_path / f"worker{i}.log",
                                      **_DETACHED))
        while True:
            status = json.loads(_cli("status", "--json", env=env).stdout)
            if sum(w["state"] == "alive" for w in status["workers"]) == 4:
                break
            assert time.monotonic() < deadline, "workers did not register"
            time.sleep(0.1)
        pids = {}
        for i, p in enumerate(procs[1:]):
            log = tmp_path / f"worker{i}.log"
            while "listening on" not in log.read_text():  # printed right after it registered
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            pids[log.read_text().split("dtorch-worker ", 1)[1].split()[0]] = p
        yield env, pids, tmp_path
    finally:
        for p in procs:  # a worker a test left stopped would not act on SIGTERM
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        stop_all(procs)


def test_a_sigstopped_worker_is_declared_lost_and_fenced_when_it_resumes(cli_cluster):
    """How soon it is declared lost is the heartbeat rule of the core (tested on a fake clock) and a figure of
    benchmarks/bench_recovery.py; here the real processes only have to get there."""
    env, pids, _ = cli_cluster
    victim, proc = sorted(pids.items())[0]
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while True:
        states = {w["worker"]: w["state"] for w in json.loads(_cli("status", "--json", env=env).stdout)["workers"]}
        if states[victim] == "lost":
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(15) == 3  # its next report is refused ("fenced") and it exits
    assert all(states[w] == "alive" for w in pids if w != victim)


def test_operator_migrates_and_drains_with_the_cli_during_a_run(cli_cluster):
    env, pids, tmp_path = cli_cluster
    bad = _cli("migrate", "nosuchsession", "--device", "0", "--to", "w0", env=env)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "unknown session 'nosuchsession'" in bad.stderr
    bad = _cli("drain", "w42", env=env)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "unknown worker 'w42'" in bad.stderr
    ready = tmp_path / "ready"
    client = subprocess.Popen([sys.executable, str(HERE / "_fault_run.py"), "cli", "--controller",
                               env["DTORCH_CONTROLLER"], "--ready", str(ready), "--at", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert time.monotonic() < deadline and client.poll() is None, client.stderr.read() if client.poll() else ""
            time.sleep(0.05)
        sid = ready.read_text()
        status = json.loads(_cli("status", "--json", env=env).stdout)
        devices = next(s for s in status["sessions"] if s["session"] == sid)["devices"]
        spare = sorted(set(pids) - set(devices.values()))[0]
        bad = _cli("migrate", sid[:8], "--device", "7", "--to", spare, env=env)
        assert bad.returncode == 1 and "no logical device 7" in bad.stderr
        moved = _cli("migrate", sid[:8], "--device", "1", "--to", spare, env=env)
        assert moved.returncode == 0, moved.stderr
        assert f"-> {spare}" in moved.stdout and "downtime" in moved.stdout
        drained = _cli("drain", devices["0"], env=env)
        assert drained.returncode == 0, drained.stderr
        assert f"drained {devices['0']}" in drained.stdout
        (tmp_path / "ready.done").touch()  # the client's last step waits for it: the CLI is slow under load
        out, err = client.communicate(timeout=120)
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode == 0, err[-3000:]
    assert_same_as_fault_free(json.loads(out.strip().splitlines()[-1]))
    status = json.loads(_cli("status", "--json", env=env).stdout)
    assert {w["worker"]: w["state"] for w in status["workers"]}[devices["0"]] == "lost"
    assert pids[devices["0"]].wait(15) == 3  # released: it exits
