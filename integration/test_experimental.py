"""`dtorch.experimental`, torch's experimental DTensor surface for ported programs: `context_parallel` lays the
DTensor buffers out sequence-sharded for the block (a Llama trains with the single-device loss and gradients) and
back after it; `implicit_replication` is accepted; what DTorch has no counterpart for says why."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.debug import CommDebugMode
from dtorch.experimental import context_parallel, implicit_replication, local_map
from dtorch.nn import replicate_module

transformers = pytest.importorskip("transformers")
TOL = dict(rtol=1e-4, atol=1e-5)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_a_llama_trains_under_context_parallel_as_on_one_device(mesh2d):
    """torchtitan's loop: inputs and labels sharded on the sequence over the "tp" dim (here the context-parallel
    one) for the block, a plain rotary table left whole; the loss and every gradient are one device's."""
    model = _llama()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    expected = model(ids, labels=ids).loss
    expected.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    replicate_module(model, mesh2d)
    inputs, labels = (dtorch.distribute_tensor(ids, mesh2d, [Shard(0), Replicate()]) for _ in range(2))
    rope = torch.randn(12, 4)  # a plain buffer: a DTorch program indexes it globally, so it stays whole
    with CommDebugMode() as comm:
        with context_parallel(mesh2d["tp"], buffers=[inputs, labels, rope], buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers={inputs}):
            assert inputs.placements == labels.placements == (Shard(0), Shard(1))
            loss = model(inputs, labels=labels).loss
            loss.backward()
    assert inputs.placements == (Shard(0), Shard(1)) and labels.placements == (Shard(0), Replicate())
    assert torch.equal(inputs.to_torch(), ids) and torch.equal(labels.to_torch(), ids) and rope.shape == (12, 4)
    torch.testing.assert_close(loss.to_torch(), expected, **TOL)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.to_torch(), grads[name], **TOL, msg=name)
    # each attention gathered its keys and values over the sequence (its queries stayed sharded)
    attention = comm.comm_module_counts["LlamaForCausalLM.model.layers.0.self_attn"]["forward"]
    assert attention[torch.ops.c10d_functional.all_gather_into_tensor] >= 2


def test_a_loop_entering_context_parallel_at_each_step_is_replayed_with_the_eager_losses(mesh1):
    """The block's in-place layout changes are operations of the step: automatic capture records the step and
    replays it, as without the block."""
    def train(auto):
        torch.manual_seed(0)
        model = replicate_module(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)),
                                 mesh1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        dtorch.auto_compile(False)
        capture = dtorch.auto_compile(auto)
        losses = []
        for _ in range(6):
            x = dtorch.distribute_tensor(torch.randn(2, 6, 8, generator=gen), mesh1, [Replicate()])
            with context_parallel(mesh1, buffers=[x], buffer_seq_dims=[1]):
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(loss.item())
        replays = capture.replays if capture else 0
        dtorch.auto_compile(True)
        return losses, replays

    (losses, replays), (eager, _) = train(True), train(False)
    assert replays >= 2 and losses == eager


def test_context_parallel_refuses_what_it_cannot_lay_out_in_one_line(mesh1, mesh2d):
    x = dtorch.distribute_tensor(torch.randn(2, 8), mesh1, [Replicate()])
    with pytest.raises(ValueError, match="2 buffers but 1 buffer_seq_dims"):
        context_parallel(mesh1, buffers=[x, x], buffer_seq_dims=[1])
    with pytest.raises(ValueError, match="buffer_seq_dims\\[0\\] is 2, but buffer 0 has 2 dims"):
        context_parallel(mesh1, buffers=[x], buffer_seq_dims=[2])
    with pytest.raises(ValueError, match="buffer 0 lives on .* neither is the 1-D mesh"):
        context_parallel(mesh2d["tp"], buffers=[x], buffer_seq_dims=[1])
    y = dtorch.distribute_tensor(torch.randn(2, 8), mesh2d, [Shard(1), Replicate()])
    with pytest.raises(ValueError, match="sequence dim 1 is already sharded on mesh dim 0"):
        context_parallel(mesh2d["tp"], buffers=[y], buffer_seq_dims=[1])
    with pytest.raises(TypeError, match="must be a dtorch.DeviceMesh"):
        context_parallel("cpu", buffers=[x], buffer_seq_dims=[1])
    with pytest.warns(UserWarning, match="no buffer is a DTensor") as caught:
        with context_parallel(mesh1, buffers=[torch.zeros(2, 8)], buffer_seq_dims=[1]):
            pass
    assert caught[0].filename == __file__
    with context_parallel(mesh1, buffers=[x], buffer_seq_dims=[-1]):  # a negative dim counts from the end
        assert x.placements == (Shard(1),)
    assert x.placements == (Replicate(),)


def test_implicit_replication_is_accepted_and_the_rest_says_why_it_is_missing(mesh1):
    full = torch.randn(4, 3)
    x = dtorch.distribute_tensor(full, mesh1, [Shard(0)])
    with implicit_replication():
        torch.testing.assert_close((x + torch.ones(4, 3)).to_torch(), full + 1)
    with pytest.raises(NotImplementedError, match="runs once, on global tensors"):
        local_map(torch.mul, out_placements=[Shard(0)])
    with pytest.raises(NotImplementedError, match="rules are its own"):
        dtorch.experimental.register_sharding(torch.ops.aten.mul.Tensor)
