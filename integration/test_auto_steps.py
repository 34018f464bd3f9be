"""Automatic capture (on by default): a plain training loop, no step marked, replayed from its third step with
exactly the eager results (_capture.py rules 7-9; real processes)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import dtorch
from _helpers import small_batches, small_mlp, tap
from dtorch import Replicate, Shard
from dtorch.nn import ColwiseParallel, RowwiseParallel, parallelize_module
from dtorch.runtime import get_session
from dtorch_protocol import messages as m

PLACE = [Shard(0), Replicate()]


def _step(net, opt, x, y):
    """One plain MSE training step; the loss."""
    loss = ((net(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


@contextlib.contextmanager
def _auto(enabled=True):
    """Automatic capture on (a fresh one: its counts are the test's) or off; on again afterwards, the default."""
    dtorch.auto_compile(False)
    try:
        yield dtorch.auto_compile(enabled)
    finally:
        dtorch.auto_compile(False)
        dtorch.auto_compile(True)


def _loop(mesh2d, batches, auto, norms=False, sent=None, dropout=0.0):
    """A TP x DP MLP trained by a plain loop that reads the loss every step (and, with `norms`, the parameters'
    norm: a second kind of step); what each step sent when `sent` is a list."""
    model = small_mlp()
    parallelize_module(model, mesh2d, {"0": ColwiseParallel(), "2": RowwiseParallel()}, tp_mesh_dim="tp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = get_session()
    losses, norm_values = [], []
    dtorch.manual_seed(3)
    with _auto(auto) as capture:
        for x, y in batches:
            dx, dy = dtorch.distribute_tensor(x, mesh2d, PLACE), dtorch.distribute_tensor(y, mesh2d, PLACE)
            items: list = []
            with tap(session, items if sent is not None else None):
                loss = ((F.dropout(model(dx), dropout, training=dropout > 0) - dy) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            if sent is not None:
                sent.append(items)
            if norms:
                norm_values.append(sum((p * p).sum() for p in model.parameters()).item())
        counts = (capture.replays, capture.fallbacks) if capture else None
    return losses, norm_values, [p.to_torch() for p in model.parameters()], counts


def test_a_plain_training_loop_is_replayed_with_the_eager_results(mesh2d):
    batches = small_batches(7)
    sent: list = []
    losses, _, params, counts = _loop(mesh2d, batches, True, sent=sent, dropout=0.2)
    eager_losses, _, eager_params, _ = _loop(mesh2d, batches, False, dropout=0.2)
    # step 1 makes AdamW's state, steps 2 and 3 make as many tensors: step 4 is recorded, steps 5-7 are replayed
    assert counts == (3, 0)
    assert losses == eager_losses and all(torch.equal(a, b) for a, b in zip(params, eager_params))
    # a replayed step sends one instruction (and loss.item()'s read mark); the recorded one sent its program's
    # definition too
    assert [type(i) for i in sent[-1]] == [m.InstrReplay, m.InstrRead] and len(sent[-1][0].tids) > 30
    assert any(type(i) is m.InstrDefine for i in sent[3]) and not any(type(i) is m.InstrReplay for i in sent[3])
    assert not any(type(i) in (m.InstrDefine, m.InstrReplay) for step in sent[:3] for i in step)


def test_two_kinds_of_steps_each_get_a_program(mesh2d):
    batches = small_batches(6)
    losses, norms, params, counts = _loop(mesh2d, batches, True, norms=True)
    eager_losses, eager_norms, eager_params, _ = _loop(mesh2d, batches, False, norms=True)
    assert counts == (5, 0)  # the training step: 4 is recorded, 5-6 replayed; the norm: 3 recorded, 4-6 replayed
    assert (losses, norms) == (eager_losses, eager_norms)
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))
    ref = small_mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    expected = [_step(ref, opt, x, y) for x, y in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    for got, want in zip(params, ref.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_a_step_that_changes_inside_falls_back_and_short_steps_define_nothing(mesh1, cluster):
    x = torch.arange(16.0)
    dx = dtorch.distribute_tensor(x, mesh1, [Shard(0)])
    sent: list = []
    with _auto() as auto, tap(cluster, sent):
        for k in (1, 1, 1, 1, 3, 1, 1, 1, 1, 1):
            t = dx * 2 + 1
            for _ in range(4):
                t = t * 0.5 + 1
            got = t.narrow(0, k, 4).sum().item()  # a number in the middle of the step
            want = x * 2 + 1
            for _ in range(4):
                want = want * 0.5 + 1
            assert got == want.narrow(0, k, 4).sum().item()
        # steps 1-2 eager, 3 recorded, 4 replayed; k=3 falls back at step 5; steps 6 and 7 run eagerly, 8 records
        # again, 9-10 replay
        assert (auto.replays, auto.fallbacks) == (3, 1)
        defined = sum(type(i) is m.InstrDefine for i in sent)
        for _ in range(5):  # one op between sync points: no program
            assert (dx + 1).sum().item() == (x + 1).sum().item()
        assert sum(type(i) is m.InstrDefine for i in sent) == defined == 2


def test_a_compiled_step_under_automatic_capture_is_its_own(mesh2d):
    model = small_mlp()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh2d, {"0": ColwiseParallel(), "2": RowwiseParallel()}, tp_mesh_dim="tp")
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)

    def train(mod, o, x, y):
        loss = ((mod(x) - y) ** 2).mean()
        o.zero_grad()
        loss.backward()
        o.step()
        return loss

    step = dtorch.compile(lambda x, y: train(model, opt, x, y))
    with _auto():
        for x, y in small_batches(5):
            loss = step(dtorch.distribute_tensor(x, mesh2d, PLACE), dtorch.distribute_tensor(y, mesh2d, PLACE))
            torch.testing.assert_close(loss.item(), train(ref, ref_opt, x, y).item(), rtol=1e-5, atol=1e-6)
    assert (step.replays, step.fallbacks) == (3, 0)


def test_a_step_ends_inside_the_op_whose_sync_point_ends_it(mesh1):
    """`.item()` of a tensor the step did not read, and of a sum it made (a redistribution inside the op, before
    its sync point): the recording ends before that op, which runs eagerly each step (rule 8)."""
    x, other = torch.arange(8.0), torch.tensor([5.0])
    dx = dtorch.distribute_tensor(x, mesh1, [Shard(0)])
    dother = dtorch.distribute_tensor(other, mesh1, [Replicate()])
    with _auto() as auto:
        for _ in range(5):
            t = dx
            for _ in range(8):
                t = t * 0.5 + 1
            assert dother.item() == 5.0
            want = x
            for _ in range(8):
                want = want * 0.5 + 1
            assert t.sum().item() == want.sum().item()
        assert (auto.replays, auto.fallbacks) == (2, 0)  # steps 1-2 eager, 3 recorded, 4-5 replayed


def test_a_background_fetch_ends_a_step_where_it_is_asked_for(mesh1):
    """`to_torch_async()` is the boundary; its fetch thread's sync point, while the next step is replayed, is not."""
    x = torch.arange(8.0)
    dx = dtorch.distribute_tensor(x, mesh1, [Shard(0)])

    def run(auto):
        w = dtorch.distribute_tensor(torch.ones(8), mesh1, [Shard(0)])
        with _auto(auto) as capture:
            futures = []
            for _ in range(6):
                for _ in range(4):
                    w.mul_(0.5).add_(dx)
                futures.append((w * 2).to_torch_async())
            values = [f.result(timeout=60) for f in futures]
            counts = (capture.replays, capture.fallbacks) if capture else None
        return values, w.to_torch(), counts

    values, w, counts = run(True)
    eager_values, eager_w, _ = run(False)
    assert counts == (3, 0)  # steps 1-2 eager, 3 recorded, 4-6 replayed
    assert all(torch.equal(a, b) for a, b in zip(values, eager_values)) and torch.equal(w, eager_w)
    want = torch.ones(8)
    for _ in range(24):
        want = want * 0.5 + x
    torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-6)


def test_an_op_that_raises_while_a_step_is_recorded_leaves_no_program(mesh1):
    x = torch.arange(8.0)
    dx = dtorch.distribute_tensor(x, mesh1, [Shard(0)])
    with _auto() as auto:
        for n in range(8):
            t = dx
            for _ in range(8):
                t = t * 0.5 + 1
            if n == 2:  # the step being recorded
                with pytest.raises(RuntimeError):
                    t @ t.reshape(2, 4)
            want = x
            for _ in range(8):
                want = want * 0.5 + 1
            assert torch.equal(t.to_torch(), want)
        # step 3 raised while recorded: steps 4 and 5 run eagerly, 6 is recorded, 7-8 are replayed
        assert (auto.replays, auto.fallbacks) == (2, 0)


def test_torch_compile_of_a_model_trains_as_torch_and_never_traces_dtorch(mesh1):
    """torch.compile graph-breaks at an op on DTensors and runs it eagerly; it then traced and compiled DTorch's own
    dispatch, frame by frame, each with a warning of its tracer ("Dynamo does not know how to trace the builtin
    `_thread.get_ident`"). DTorch's packages are on its skip list, as numpy is (`_sharding`)."""
    import warnings

    torch.manual_seed(0)
    ref = small_mlp()
    model = copy.deepcopy(ref)
    dtorch.nn.replicate_module(model, mesh1)
    compiled = torch.compile(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    torch._dynamo.utils.warn_once_cache.clear()  # its tracer warns once a process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(8, 8, generator=gen)
            for net, o, inp in ((compiled, opt, dtorch.distribute_tensor(x, mesh1, [Shard(0)])), (ref, ref_opt, x)):
                o.zero_grad()
                net(inp).pow(2).mean().backward()
                o.step()
    assert not [w for w in caught if "Dynamo" in str(w.message)], [str(w.message)[:100] for w in caught]
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.to_torch(), r.detach(), rtol=1e-5, atol=1e-6)


def test_batches_uploaded_by_another_thread_train_as_torch_and_end_automatic_capture(mesh1):
    """A thread that uploads the next batches while the loop trains (prefetching) called into the session's step:
    its uploads interrupted a replay from the other thread and its tensor ids went into the program
    ("IndexError: list index out of range" in the replay). Another thread's calls now run eagerly, and the first
    one ends automatic capture for the session, with a warning (rule 10)."""
    import queue
    import threading
    import warnings

    ref, model = small_mlp(), parallelize_module(small_mlp(), mesh1, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.05), torch.optim.SGD(model.parameters(), lr=0.05)
    batches = small_batches(24)
    want = [_step(ref, ref_opt, x, y) for x, y in batches]
    ready: queue.Queue = queue.Queue(maxsize=3)

    def prefetch():
        for x, y in batches[4:]:
            ready.put((dtorch.distribute_tensor(x, mesh1, [Replicate()]),
                       dtorch.distribute_tensor(y, mesh1, [Replicate()])))

    got = []
    with _auto() as capture, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches[:4]:  # steps of this thread alone: recorded, then replayed
            got.append(_step(model, opt, dtorch.distribute_tensor(x, mesh1, [Replicate()]),
                             dtorch.distribute_tensor(y, mesh1, [Replicate()])))
        assert capture.replays >= 1
        producer = threading.Thread(target=prefetch, daemon=True)
        producer.start()
        for _ in batches[4:]:
            got.append(_step(model, opt, *ready.get(timeout=60)))
        producer.join(timeout=60)
        assert capture.stopped and get_session().step is None
    assert any("automatic capture is off" in str(w.message) for w in caught)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
