"""dtorch.compile(mode="graph"): a verified step runs without its Python and gives the eager results (real
processes). The rules are at the top of dtorch/_graph.py."""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import dtorch
from _helpers import mlp_train_step, tap
from dtorch import Replicate, Shard
from dtorch.nn import ColwiseParallel, RowwiseParallel, parallelize_module
from dtorch_protocol import messages as m

PLACE = [Shard(0), Replicate()]


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _body(model, opt, dropout=0.0):
    calls = []

    def step(x, y):
        calls.append(1)  # counts the calls that ran the Python
        return mlp_train_step(model, opt, x, y, dropout)

    return step, calls


def _batches(n, rows=8):
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(rows, 8, generator=gen), torch.randn(rows, 8, generator=gen)) for _ in range(n)]


def _train(mesh2d, batches, mode, dropout=0.0, optimizer=None):
    """A TP x DP MLP trained with SGD + momentum, through `dtorch.compile(mode=...)` or plain calls (mode None)."""
    model = _mlp()
    parallelize_module(model, mesh2d, {"0": ColwiseParallel(), "2": RowwiseParallel()}, tp_mesh_dim="tp")
    opt = (optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)))(model.parameters())
    body, calls = _body(model, opt, dropout)
    step = dtorch.compile(body, mode=mode) if mode else body
    dtorch.manual_seed(3)
    losses = [step(dtorch.distribute_tensor(x, mesh2d, PLACE), dtorch.distribute_tensor(y, mesh2d, PLACE))
              for x, y in batches]  # each call's loss kept: a graph returns new DTensors (rule 3)
    grads = [p.grad.to_torch() for p in model.parameters()]
    return [loss.item() for loss in losses], [p.to_torch() for p in model.parameters()], grads, step, len(calls)


def test_a_graph_trains_without_its_python_bit_for_bit_as_eager_and_as_plain_torch(mesh2d):
    batches = _batches(7)
    losses, params, grads, step, ran = _train(mesh2d, batches, "graph")
    eager_losses, eager_params, eager_grads, _, _ = _train(mesh2d, batches, None)
    # call 1 warms up, 2 records, 3 replays and verifies, 4-7 are the graph: the Python ran 3 times
    assert (ran, step.replays, step.graphed, step.fallbacks, step.no_graph) == (3, 5, 4, 0, None)
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads))  # .grad names the last call's gradients
    ref = _mlp()
    body, _ = _body(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9))
    expected = [body(x, y).item() for x, y in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    for got, want in zip(params, ref.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def _live(session) -> int:
    """Tensors the controller holds for `session` once everything dropped here was released and sent."""
    gc.collect()
    session.sync()
    return next(s.tensors for s in dtorch.status().sessions if s.session == session.id)


def test_a_graph_call_sends_one_replay_and_releases_what_the_python_would_have_dropped(mesh2d, cluster):
    held = _live(cluster)
    model = _mlp()
    parallelize_module(model, mesh2d, {"0": ColwiseParallel(), "2": RowwiseParallel()}, tp_mesh_dim="tp")
    body, _ = _body(model, torch.optim.SGD(model.parameters(), lr=0.05))
    step = dtorch.compile(body, mode="graph")
    sent, released = [], []
    grads = None
    for n, (x, y) in enumerate(_batches(5)):
        dx, dy = dtorch.distribute_tensor(x, mesh2d, PLACE), dtorch.distribute_tensor(y, mesh2d, PLACE)
        with tap(cluster, sent, released):
            step(dx, dy).item()
        if n == 4:  # a graph call: one replay (then .item()'s read mark); each .grad is the same object, naming
            # a new tensor
            assert [type(i) for i in sent] == [m.InstrReplay, m.InstrRead]
            now = [(p.grad, p.grad._tid) for p in model.parameters()]
            assert all(g is h for (g, _), (h, _) in zip(now, grads))
            assert all(t != old and old in released for (_, t), (_, old) in zip(now, grads))
        grads = [(p.grad, p.grad._tid) for p in model.parameters()]
        sent.clear()
        released.clear()
    assert step.graphed == 2
    del model, body, step, grads, now, dx, dy
    assert _live(cluster) == held  # every tensor the steps made is gone once the Python dropped it


def test_random_ops_in_a_graph_draw_the_seeds_an_eager_run_draws(mesh2d):
    batches = _batches(5)
    losses, params, _, step, _ = _train(mesh2d, batches, "graph", dropout=0.3)
    eager_losses, eager_params, _, _, _ = _train(mesh2d, batches, None, dropout=0.3)
    assert step.graphed == 2 and losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


def test_a_new_shape_runs_the_python_and_the_graph_comes_back(mesh2d):
    batches = _batches(4) + _batches(1, rows=4) + _batches(4)
    losses, params, _, step, ran = _train(mesh2d, batches, "graph")
    eager_losses, eager_params, _, _, _ = _train(mesh2d, batches, None)
    # 1 warm-up, 2 record, 3 verify, 4 graph; 5 (4 rows) misses and falls back, 6 records, 7 verifies, 8-9 graph
    assert (ran, step.graphed, step.fallbacks) == (6, 3, 1)
    assert losses == eager_losses and all(torch.equal(a, b) for a, b in zip(params, eager_params))


def test_adamw_step_sizes_keep_the_python_running_and_say_why(mesh2d):
    batches = _batches(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, params, _, step, ran = _train(mesh2d, batches, "graph",
                                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    eager_losses, eager_params, _, _, _ = _train(mesh2d, batches, None,
                                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    assert (ran, step.graphed, step.replays) == (5, 0, 3)
    assert "numbers in its ops change from call to call" in step.no_graph
    assert any("mode='graph' refused" in str(w.message) for w in caught)
    assert losses == eager_losses and all(torch.equal(a, b) for a, b in zip(params, eager_params))


def test_a_step_that_reads_what_the_previous_call_made_stays_a_replay(mesh1):
    state = {}

    def accumulate(x):
        state["total"] = state["total"] + x * 2 if "total" in state else x * 2
        return state["total"] + 1

    step = dtorch.compile(accumulate, mode="graph")
    xs = [torch.full((4,), float(i)) for i in range(5)]
    with pytest.warns(UserWarning, match="not the one the recording read"):
        outs = [step(dtorch.distribute_tensor(x, mesh1, [Shard(0)])).to_torch() for x in xs]
    expected, total = [], torch.zeros(4)
    for x in xs:
        total = total + x * 2
        expected.append(total + 1)
    assert step.graphed == 0 and all(torch.equal(a, b) for a, b in zip(outs, expected))


def test_a_step_that_returns_what_it_keeps_stays_a_replay(mesh1):
    kept = {}

    def step_fn(x):
        kept["last"] = x * 3
        return kept["last"]

    step = dtorch.compile(step_fn, mode="graph")
    with pytest.warns(UserWarning, match="also keeps elsewhere"):
        for i in range(4):
            out = step(dtorch.distribute_tensor(torch.full((4,), float(i)), mesh1, [Shard(0)]))
            assert torch.equal(out.to_torch(), torch.full((4,), 3.0 * i))
            assert torch.equal(kept["last"].to_torch(), torch.full((4,), 3.0 * i))
    assert step.graphed == 0


def test_arguments_are_checked_and_a_plain_number_that_changes_runs_the_python(mesh1):
    w = dtorch.distribute_tensor(torch.arange(4.0), mesh1, [Shard(0)])

    def scaled(x, k):
        return x * w + k

    step = dtorch.compile(scaled, mode="graph")
    x = dtorch.distribute_tensor(torch.ones(4), mesh1, [Shard(0)])
    for k in (1, 1, 1, 1, 5):
        assert torch.equal(step(x, k).to_torch(), torch.arange(4.0) + k)
    assert step.graphed == 1  # call 4; call 5's k differs: the Python ran (and the number became a hole)
    out = step(dtorch.distribute_tensor(torch.ones(4), mesh1, [Replicate()]), 5)  # another layout
    assert torch.equal(out.to_torch(), torch.arange(4.0) + 5)


def test_a_bad_mode_is_one_clear_error():
    with pytest.raises(ValueError, match=r"mode='cuda-graph'; expected one of 'replay', 'graph'"):
        dtorch.compile(lambda x: x, mode="cuda-graph")


def test_gradients_dropped_between_calls_bring_the_python_back_with_a_warning(mesh2d):
    """zero_grad() outside the step drops the .grad the graph would re-point: the Python must run (rule 2)."""
    batches = _batches(6)
    model = _mlp()
    parallelize_module(model, mesh2d, {"0": ColwiseParallel(), "2": RowwiseParallel()}, tp_mesh_dim="tp")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def forward_backward(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    step = dtorch.compile(forward_backward, mode="graph")
    ref = _mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    with pytest.warns(UserWarning, match="dropped between calls"):
        for x, y in batches:
            loss = step(dtorch.distribute_tensor(x, mesh2d, PLACE), dtorch.distribute_tensor(y, mesh2d, PLACE))
            opt.step()
            opt.zero_grad()
            ref_loss = ((ref(x) - y) ** 2).mean()
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=1e-5, atol=1e-6)
    assert step.graphed == 0 and step.replays == 4
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got.to_torch(), want.detach(), rtol=1e-5, atol=1e-6)


def test_dtorch_adamw_makes_the_whole_step_a_graph_and_trains_as_torch_adamw(mesh2d):
    batches = _batches(7)
    losses, params, _, step, ran = _train(mesh2d, batches, "graph", optimizer=lambda ps: dtorch.optim.AdamW(ps, 1e-2))
    eager_losses, eager_params, _, _, _ = _train(mesh2d, batches, None,
                                                 optimizer=lambda ps: dtorch.optim.AdamW(ps, 1e-2))
    assert (ran, step.graphed, step.no_graph) == (3, 4, None)  # no number of its update changes in Python
    assert losses == eager_losses and all(torch.equal(a, b) for a, b in zip(params, eager_params))
    ref = _mlp()
    body, _ = _body(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    expected = [body(x, y).item() for x, y in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    for got, want in zip(params, ref.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-6)  # torch's rounding: Python floats


def test_a_learning_rate_changed_between_calls_runs_the_python(mesh2d):
    """dtorch.optim.AdamW's hyperparameters are the graph's guard (rule 2): a graph never uses a stale lr."""
    batches = _batches(7)
    results = []
    for mode in ("graph", None):
        model = _mlp()
        parallelize_module(model, mesh2d, {"0": ColwiseParallel(), "2": RowwiseParallel()}, tp_mesh_dim="tp")
        opt = dtorch.optim.AdamW(model.parameters(), lr=1e-2)
        body, calls = _body(model, opt)
        step = dtorch.compile(body, mode=mode) if mode else body
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the new lr is a new number: the step stays a replay after it
            for n, (x, y) in enumerate(batches):
                if n == 5:
                    opt.param_groups[0]["lr"] = 1e-3
                losses.append(step(dtorch.distribute_tensor(x, mesh2d, PLACE),
                                   dtorch.distribute_tensor(y, mesh2d, PLACE)).item())
        results.append((losses, [p.to_torch() for p in model.parameters()], step, len(calls)))
    (losses, params, step, ran), (eager_losses, eager_params, _, _) = results
    assert (step.graphed, ran) == (2, 5)  # calls 4-5 were graphs; 6 ran its Python for the new lr, and so did 7
    assert losses == eager_losses and all(torch.equal(a, b) for a, b in zip(params, eager_params))


def test_dtorch_adamw_refuses_bad_input_in_one_line(mesh1):
    with pytest.raises(ValueError, match=r"dtorch.optim.AdamW: lr=-1.0; expected a value in its range"):
        dtorch.optim.AdamW([dtorch.distribute_tensor(torch.ones(4), mesh1, [Shard(0)])], lr=-1.0)
    with pytest.raises(TypeError, match=r"parameter 0 is a Parameter; expected DTensors"):
        dtorch.optim.AdamW([nn.Parameter(torch.ones(4))])


def test_an_inference_step_as_a_graph_returns_new_outputs_that_the_caller_may_keep(mesh2d):
    model = _mlp()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh2d, {"0": ColwiseParallel(), "2": RowwiseParallel()}, tp_mesh_dim="tp")

    @dtorch.compile(mode="graph")
    def infer(x):
        with torch.no_grad():
            return model(x)

    xs = [x for x, _ in _batches(6)]
    outs = [infer(dtorch.distribute_tensor(x, mesh2d, PLACE)) for x in xs]  # all kept: each call's own
    assert infer.graphed == 3
    with torch.no_grad():
        for out, x in zip(outs, xs):
            torch.testing.assert_close(out.to_torch(), ref(x), rtol=1e-5, atol=1e-6)


RECONNECT = """
import torch, dtorch
from dtorch import Shard
step = dtorch.compile(lambda x: (x * 2 + 1).sum() + (x - 3).abs().mean() + x.max() + x.min() + x.mean(), mode="graph")
for session in range(2):
    dtorch.connect(workers=2)
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    for i in range(4):
        t = torch.arange(4.0) + i
        got = step(dtorch.distribute_tensor(t, mesh, [Shard(0)])).item()
        assert got == step.fn(t).item(), (session, i, got)
    dtorch.shutdown()
print("graphed", step.graphed)
"""


def test_a_compiled_step_called_in_a_new_session_starts_over_there():
    """Its program was defined in the session it was recorded in: another session (a reconnect) records its own,
    instead of replaying an id the controller never saw there ("unknown program")."""
    env = {k: v for k, v in os.environ.items() if k != "DTORCH_CONTROLLER"}
    out = subprocess.run([sys.executable, "-c", RECONNECT], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("graphed 2")  # call 4 of each session
