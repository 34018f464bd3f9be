"""dtorch.compile: a training step captured once and replayed gives exactly the eager results (real processes)."""

from __future__ import annotations

import copy
import warnings

import msgspec
import pytest
import torch

import dtorch
from _helpers import mlp_train_step, small_batches, small_mlp
from dtorch import Replicate, Shard
from dtorch.nn import ColwiseParallel, RowwiseParallel, parallelize_module
from dtorch_protocol import messages as m

OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),  # AdamW: step sizes change every step
              "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True)}  # ... in lists


def _train(mesh2d, batches, compiled, dropout=0.0, optimizer="sgd"):
    """A TP x DP MLP trained by `dtorch.compile`d steps or plain calls; losses, parameters."""
    model = small_mlp()
    parallelize_module(model, mesh2d, {"0": ColwiseParallel(), "2": RowwiseParallel()}, tp_mesh_dim="tp")
    opt = OPTIMIZERS[optimizer](model.parameters())
    step = dtorch.compile(lambda x, y: mlp_train_step(model, opt, x, y, dropout))
    run = step if compiled else step.fn
    dtorch.manual_seed(3)
    losses = []
    for x, y in batches:
        place = [Shard(0), Replicate()]
        losses.append(run(dtorch.distribute_tensor(x, mesh2d, place), dtorch.distribute_tensor(y, mesh2d, place)))
    return [loss.item() for loss in losses], [p.to_torch() for p in model.parameters()], step


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_replayed_training_matches_eager_bit_for_bit_and_plain_torch(mesh2d, optimizer):
    batches = small_batches(6)
    losses, params, step = _train(mesh2d, batches, compiled=True, optimizer=optimizer)
    eager_losses, eager_params, _ = _train(mesh2d, batches, compiled=False, optimizer=optimizer)
    assert (step.replays, step.fallbacks, step.unreplayable) == (4, 0, None)  # call 1 warms up, call 2 records
    assert losses == eager_losses and all(torch.equal(a, b) for a, b in zip(params, eager_params))
    if optimizer.startswith("adamw"):
        assert step.program.nscalars > 0  # its step sizes are the replay's numbers
        # each op with holes reads them from its key, unplanned (a list of equal step sizes: in order)
        assert all(step.program.ops[i].numbers is not None for i in step.program.holes)
    ref = small_mlp()
    opt = OPTIMIZERS[optimizer](ref.parameters())
    expected = [mlp_train_step(ref, opt, x, y).item() for x, y in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    for got, want in zip(params, ref.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_random_ops_in_a_replay_draw_the_seeds_an_eager_run_draws(mesh2d):
    batches = small_batches(5)
    losses, params, step = _train(mesh2d, batches, compiled=True, dropout=0.3)
    eager_losses, eager_params, _ = _train(mesh2d, batches, compiled=False, dropout=0.3)
    assert step.replays == 3 and losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


def test_a_replay_sends_one_instruction_and_a_new_shape_falls_back_for_that_step(mesh2d, cluster):
    batches = small_batches(3) + small_batches(1, rows=4) + small_batches(2)
    model = small_mlp()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh2d, {"0": ColwiseParallel(), "2": RowwiseParallel()}, tp_mesh_dim="tp")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    step = dtorch.compile(lambda x, y: mlp_train_step(model, opt, x, y))
    sent: list = []
    eager_emit = cluster.emit
    for n, (x, y) in enumerate(batches):
        place = [Shard(0), Replicate()]
        dx, dy = dtorch.distribute_tensor(x, mesh2d, place), dtorch.distribute_tensor(y, mesh2d, place)
        cluster.emit = lambda item: (sent.append(item), eager_emit(item))[1]
        try:
            loss = step(dx, dy)
        finally:
            cluster.emit = eager_emit
        if n == 2:  # replayed: only the program id, the tensor ids and the seeds went out
            assert [type(i) for i in sent] == [m.InstrReplay] and len(sent[0].tids) > 50
        sent.clear()
        torch.testing.assert_close(loss.item(), mlp_train_step(ref, ref_opt, x, y).item(), rtol=1e-5, atol=1e-6)
    # step 3 has 4 rows: it falls back, step 4 records again, step 5 replays
    assert (step.replays, step.fallbacks) == (2, 1)
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got.to_torch(), want.detach(), rtol=1e-5, atol=1e-6)


def test_a_step_with_a_sync_point_runs_eagerly_and_says_why(mesh1):
    w = dtorch.distribute_tensor(torch.ones(4), mesh1, [Shard(0)])
    seen = []

    @dtorch.compile
    def step(x):
        w.add_(x)
        seen.append(w.sum().item())  # a sync point: a replay could not give this value
        return w * 2

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [step(dtorch.distribute_tensor(torch.full((4,), float(i)), mesh1, [Shard(0)])) for i in range(4)]
    assert step.unreplayable == "a sync point" and step.replays == 0
    assert any("runs eagerly: a sync point" in str(c.message) for c in caught)
    assert seen == [4.0, 8.0, 16.0, 28.0] and torch.equal(outs[-1].to_torch(), torch.full((4,), 14.0))


def test_compiled_steps_nest_and_raise_like_eager(mesh1):
    x = dtorch.distribute_tensor(torch.arange(4.0), mesh1, [Shard(0)])
    inner = dtorch.compile(lambda t: t + 1)
    outer = dtorch.compile(lambda t: inner(t) * 2)
    assert [outer(x).to_torch().tolist() for _ in range(3)] == [[2.0, 4.0, 6.0, 8.0]] * 3
    assert outer.replays == 1 and inner.replays == 0  # inside a recording or replay, a step is just its ops

    @dtorch.compile
    def bad(t):
        return t @ t.reshape(2, 2)

    for _ in range(3):
        with pytest.raises(RuntimeError, match="aten.mm|size mismatch|must be"):
            bad(x)


def test_compiled_llama_dp_x_tp_training_matches_plain_torch(mesh2d):
    """The DPxTP Llama example under dtorch.compile: AdamW, plain tensors mixed in by transformers (masks,
    positions), clip_grad_norm_; six steps, four of them replayed, losses equal to plain torch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dtorch.nn import llama_tp_plan

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh2d, llama_tp_plan(), tp_mesh_dim="tp")
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)

    def train(m, o, ids):
        loss = m(ids, labels=ids).loss
        o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        o.step()
        return loss

    step = dtorch.compile(lambda ids: train(model, opt, ids))
    gen = torch.Generator().manual_seed(3)
    got, expected = [], []
    for _ in range(6):
        ids = torch.randint(0, 96, (4, 8), generator=gen)
        got.append(step(dtorch.distribute_tensor(ids, mesh2d, [Shard(0), Replicate()])))
        expected.append(train(ref, ref_opt, ids).item())
    assert (step.replays, step.fallbacks, step.unreplayable) == (4, 0, None)
    torch.testing.assert_close(torch.tensor([g.item() for g in got]), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_a_step_writing_through_views_of_moved_copies_replays_with_torchs_values(mesh4):
    """`t[1] = ...` of a row-sharded t writes through a view of a moved copy, which is copied back (dtorch._views):
    the replayed program does the same. A view of a moved copy kept from before a step makes that step eager, with
    a warning saying why: the program was recorded without it."""
    x = torch.arange(32.0).view(8, 4)
    dx = dtorch.distribute_tensor(x, mesh4, [Shard(0)])

    @dtorch.compile
    def step(t):
        t[1] = t[1] * 2 + 1
        t[2:6, 1:3].add_(1)
        return t.sum()

    def torch_step(t):
        t[1] = t[1] * 2 + 1
        t[2:6, 1:3].add_(1)
        return t.sum()

    for _ in range(5):
        assert step(dx).item() == torch_step(x).item()
        assert torch.equal(dx.to_torch(), x)
    assert (step.replays, step.fallbacks, step.unreplayable) == (3, 0, None)
    row = dx[1]
    with pytest.warns(UserWarning, match="reaches a view of a copy moved before the step"):
        for _ in range(2):
            step(dx)
            torch_step(x)
            assert torch.equal(row.to_torch(), x[1]) and torch.equal(dx.to_torch(), x)


def test_an_integer_argument_that_changes_falls_back_for_that_step(mesh1):
    x = torch.arange(8.0)
    dx = dtorch.distribute_tensor(x, mesh1, [Shard(0)])

    @dtorch.compile
    def step(t, k):
        return t.narrow(0, k, 4) * 2  # aten.slice(t, 0, k, k + 4): its numbers are in the replay's guard

    for k in (1, 1, 1, 1, 3, 1):
        torch.testing.assert_close(step(dx, k).to_torch(), x.narrow(0, k, 4) * 2, rtol=0, atol=0)
    # call 1 eager, 2 recorded, 3-4 replayed, 5 (k=3) falls back, 6 records again
    assert (step.replays, step.fallbacks) == (2, 1)


def test_a_definition_sent_is_not_changed_by_holes_a_later_replay_finds(mesh1, monkeypatch):
    from dtorch import _capture

    sent, define = [], _capture._definition
    monkeypatch.setattr(_capture, "_definition", lambda s, p: sent.append(define(s, p)) or sent[-1])
    w = dtorch.distribute_tensor(torch.ones(4), mesh1, [Shard(0)])
    scale = [1.0]

    @dtorch.compile
    def step(x):
        scale[0] *= 0.5  # a number that changes every step: a hole from the first replay on (rule 6)
        w.mul_(scale[0])
        return w + x

    x = dtorch.distribute_tensor(torch.zeros(4), mesh1, [Shard(0)])
    outs = [step(x) for _ in range(5)]
    assert step.replays == 3 and len(sent) == 2  # recorded at call 2, holes found at 3
    first, second = (msgspec.json.encode(d.instrs) for d in sent)
    assert sent[0].nscalars == 0 and b'"$s"' not in first  # as it was when it was emitted
    assert sent[1].nscalars == 1 and b'"$s"' in second
    torch.testing.assert_close(outs[-1].to_torch(), torch.full((4,), 0.5 ** 15), rtol=0, atol=0)


def test_a_size_argument_that_changes_falls_back_for_that_step(mesh1):
    x = torch.arange(16.0)
    dx = dtorch.distribute_tensor(x, mesh1, [Replicate()])

    @dtorch.compile
    def step(t, shape):
        return t.view(shape) * 2  # aten.view(t, [sizes]): a nested key, matched by the replay too

    for shape in ([4, 4], [4, 4], [4, 4], [2, 8], [4, 4], [4, 4]):
        torch.testing.assert_close(step(dx, shape).to_torch(), x.view(shape) * 2, rtol=0, atol=0)
    # call 1 eager, 2 recorded, 3 replayed, 4 ([2, 8]) falls back, 5 records again, 6 replayed
    assert (step.replays, step.fallbacks) == (2, 1)
