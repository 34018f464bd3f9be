"""`dtorch.profile()` on the embedded cluster: per-op and per-worker times, redistributions with their bytes, the
user's source lines, a Chrome trace Perfetto reads, and each suggestion on a workload built to trigger it (and
not on one built not to)."""

from __future__ import annotations

import json

import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch import _profile_report as report
from dtorch.nn import ColwiseParallel, RowwiseParallel, parallelize_module
from dtorch.profiling import Profile
from dtorch_protocol import auth, wire


def rules(p: Profile) -> set[str]:
    return {s.rule for s in p.suggestions()}


def test_a_redistribution_for_an_op_is_measured_and_named(mesh1, tmp_path):
    a = dtorch.rand((2048, 1024), device_mesh=mesh1, placements=[Shard(0)])
    b = dtorch.rand((2048, 1024), device_mesh=mesh1, placements=[Shard(1)])
    with dtorch.profile() as p:
        c = a + b  # one operand changes layout for the add
        c.sum().item()
    rep = p.report
    (site,) = rep.moves
    assert site.op == "aten.add.Tensor" and "test_profile.py" in site.line
    assert (site.src_placements, site.dst_placements) == (("S1",), ("S0",))  # b follows a's layout
    # every device needs the half of the other operand its peer holds: a quarter of 8 MiB each way (on
    # collectives, each rank's contribution ends with one flag element: collectives.py rule 6)
    assert 0 <= site.moved_bytes - 2 * (2048 * 1024 * 4 // 4) <= 2 * 4 and rep.moved_bytes == site.moved_bytes
    assert "redistribution" in rules(p)
    text = p.table()
    assert "(Shard(dim=1)) -> (Shard(dim=0))" in text
    assert "aten.add.Tensor" in text and "test_profile.py" in text and "suggestions:" in text
    assert all(w.window_s > 0 for w in rep.workers) and len(rep.workers) == 2
    p.export_chrome_trace(tmp_path / "trace.json")
    trace = json.loads((tmp_path / "trace.json").read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in complete} >= {"aten.add.Tensor", "collective", "aten.sum.default"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    assert any("test_profile.py" in e["args"]["source"] for e in complete)  # ops the fast path replays may carry none
    assert {e["pid"] for e in complete} == {0, 1}
    torch.testing.assert_close(c.to_torch(), a.to_torch() + b.to_torch())


def test_a_collective_record_says_when_it_landed_after_its_issue_and_before_its_first_use_ended(mesh1):
    """What (f) of bench_vs_torch measures overlap with: a collective's record carries when its transfer finished
    on that worker, after its command started and no later than the end of the first command that reads it."""
    x = dtorch.ones((256, 256), device_mesh=mesh1, placements=[Partial()])
    with dtorch.profile() as p:
        y = x.redistribute(mesh1, [Replicate()])
        (y * 2).sum().item()
    assert len(p.report.records) == 2
    for records in p.report.records.values():
        (issued,) = [r for r in records if r.op == "collective"]
        (use,) = [r for r in records if r.op == "aten.mul.Tensor"]
        assert issued.start < issued.landed <= use.start + use.seconds + 1e-3, (issued, use)
        assert all(r.landed == 0.0 for r in records if r.op != "collective")
    torch.testing.assert_close(y.to_torch(), x.to_torch())


def test_a_replayed_steps_redistributions_are_those_of_its_program(mesh1):
    """A steady training loop replays its captured step (one instruction per step): the profile names each of
    its redistributions per step, with its op and its bytes, as for the eager steps (it named none)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    parallelize_module(model, mesh1, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = dtorch.distribute_tensor(torch.randn(8, 64), mesh1, [Replicate()])

    def step():
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    def profiled(auto):
        dtorch.auto_compile(False)
        capture = dtorch.auto_compile(auto)
        for _ in range(4):
            step()
        with dtorch.profile() as p:
            for _ in range(3):
                step()
        replays = capture.replays if capture else 0
        dtorch.auto_compile(True)
        return {(r.src_placements, r.dst_placements, r.op): (r.calls, r.moved_bytes) for r in p.report.moves}, replays

    replayed, replays = profiled(True)
    eager, _ = profiled(False)
    assert replays >= 4 and replayed == eager
    assert eager[(("Psum",), ("R",), "")][0] == 3  # the rowwise output's all_reduce (its style's), per step
    assert eager[(("R",), ("Psum",), "aten.addmm.default")][0] == 3  # the bias, made a Partial for the addmm


def test_the_same_redistribution_repeated_is_pointed_out(mesh1):
    x = dtorch.rand((64, 64), device_mesh=mesh1, placements=[Shard(0)])
    with dtorch.profile() as p:
        for _ in range(3):
            x.redistribute(mesh1, [Replicate()]).sum().item()
    (tip,) = [s for s in p.suggestions() if s.rule == "repeated"]
    assert "3 times" in tip.text and f"tensor {x._tid}" in tip.text


def test_a_worker_left_idle_is_pointed_out_and_a_balanced_step_is_not(cluster):
    one = dtorch.DeviceMesh("cpu", [0])
    both = dtorch.DeviceMesh("cpu", [0, 1])
    w = dtorch.rand((768, 768), device_mesh=one, placements=[Replicate()])  # ~10 ms a matmul: the work, not the
    v = dtorch.rand((768, 384), device_mesh=both, placements=[Shard(0)])  # the session holds both workers

    def chain(y, f):
        for _ in range(12):
            y = f(y)
        y.sum().item()

    chain(w, lambda y: (y @ w / 768).tanh())  # planned once outside the profile (else, early in a fresh process,
    with dtorch.profile() as p:  # the window is the client's planning time) and big enough to outweigh the RPCs
        chain(w, lambda y: (y @ w / 768).tanh())  # that open and close the window: the test is not timing-bound
    assert "imbalance" in rules(p), p.table()
    idle = max(p.report.workers, key=lambda t: t.idle_s)
    assert f"worker {idle.address} idle" in next(s.text for s in p.suggestions() if s.rule == "imbalance")
    chain(v, lambda z: (z * 1.01).tanh())
    with dtorch.profile() as q:
        chain(v, lambda z: (z * 1.01).tanh())
    assert "imbalance" not in rules(q) and "small_ops" not in rules(q) and not q.report.moves, q.table()


def test_many_tiny_ops_are_pointed_out(mesh1):
    t = dtorch.ones((4,), device_mesh=mesh1, placements=[Replicate()])
    with dtorch.profile() as p:
        for _ in range(120):
            t = t + 1
        t.sum().item()
    assert "small_ops" in rules(p)
    assert t.to_torch().tolist() == [121.0] * 4


def test_a_step_that_syncs_all_the_time_is_pointed_out(mesh1):
    t = dtorch.ones((8,), device_mesh=mesh1, placements=[Shard(0)])
    with dtorch.profile() as p:
        for _ in range(15):
            (t * 2).sum().item()  # a sync point per iteration: the workers wait for the client
    (tip,) = [s for s in p.suggestions() if s.rule == "client_bound"]
    assert "sync points inside the step" in tip.text


def test_a_worker_too_old_to_profile_is_one_line_and_the_profile_goes_on(capsys):
    """A worker without the Profile service (an older dtorch-worker): gRPC answers UNIMPLEMENTED."""
    served = wire.serve("dtorch.Worker", object(), lambda credential: auth.Caller(auth.CLIENT, "s"))
    server, address = served.server, served.address
    try:
        p = Profile()
        p._session = type("S", (), {"id": "s"})()
        p._stubs[address] = wire.Stub("dtorch.Worker", address, "")
        p._caps[address] = "cap"
        assert p._call(address, True) is None
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"worker at {address} is too old to report a profile" in err
        p._stubs[address].close()
        rep = report.build({}, {}, p._missing)
        assert report.table(rep).startswith(f"note: worker at {address} is too old")
    finally:
        server.stop(0)
