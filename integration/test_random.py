"""Random values do not depend on the parallel plan: same seed, same numbers, whatever the mesh and placements."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Replicate, Shard


def _layouts(mesh1, mesh4, mesh2d):
    return [(mesh1, [Shard(0)]), (mesh4, [Shard(1)]), (mesh4, [Replicate()]), (mesh2d, [Shard(0), Shard(1)])]


def test_dropout_is_plan_independent(mesh1, mesh4, mesh2d):
    full = torch.randn(8, 6)
    masks = []
    for mesh, placements in _layouts(mesh1, mesh4, mesh2d):
        x = dtorch.distribute_tensor(full, mesh, placements)
        dtorch.manual_seed(7)
        masks.append(F.dropout(x, p=0.5, training=True).to_torch())
    for other in masks[1:]:
        assert torch.equal(masks[0], other)
    kept = masks[0] != 0
    assert 0 < kept.sum() < full.numel()
    torch.testing.assert_close(masks[0][kept], full[kept] * 2)


def test_in_place_init_is_plan_independent(mesh1, mesh4, mesh2d):
    values = []
    for mesh, placements in _layouts(mesh1, mesh4, mesh2d):
        w = dtorch.zeros(6, 8, device_mesh=mesh, placements=placements)
        dtorch.manual_seed(11)
        torch.nn.init.normal_(w, std=0.02)
        values.append(w.to_torch())
    for other in values[1:]:
        assert torch.equal(values[0], other)
    assert 0 < values[0].std() < 0.05


@pytest.mark.parametrize("call", ["uniform_(3, -1)", "normal_(0, -1)", "bernoulli_(2.0)", "init.normal_(std=-2)"])
def test_bad_arguments_of_an_in_place_random_op_raise_torchs_error_at_once(mesh4, call):
    """On a sharded tensor these ops draw their values from a random factory; their arguments were never checked, so
    `uniform_(3, -1)` filled the range upside down, `normal_(std=-1)` a mirrored normal and `bernoulli_(2.0)` ones,
    where torch raises. torch's checks now run first: the same error, at the call, and the tensor is unchanged."""
    ops = {"uniform_(3, -1)": lambda t: t.uniform_(3, -1), "normal_(0, -1)": lambda t: t.normal_(0, -1),
           "bernoulli_(2.0)": lambda t: t.bernoulli_(2.0),
           "init.normal_(std=-2)": lambda t: torch.nn.init.normal_(t, std=-2.0)}
    full = torch.randn(8, 6)
    with pytest.raises(RuntimeError) as want:
        ops[call](full.clone())
    x = dtorch.distribute_tensor(full, mesh4, [Shard(1)])
    with pytest.raises(RuntimeError) as got:
        ops[call](x)
    assert str(got.value) == str(want.value)
    assert torch.equal(x.full_tensor(), full)


def test_random_write_through_a_view_reaches_the_base(mesh4):
    w = dtorch.zeros(8, 6, device_mesh=mesh4, placements=[Shard(0)])
    torch.nn.init.uniform_(w[:, 2], 1, 2)  # a real view: dim 1 is not sharded
    full = w.to_torch()
    assert (full[:, 2] >= 1).all() and (full[:, [0, 1, 3, 4, 5]] == 0).all()


def test_rand_like_and_factories_follow_the_seed(mesh4):
    dtorch.manual_seed(3)
    a = dtorch.rand(5, 5, device_mesh=mesh4, placements=[Shard(0)])
    b = torch.rand_like(a)
    dtorch.manual_seed(3)
    a2 = dtorch.rand(5, 5, device_mesh=mesh4, placements=[Replicate()])
    b2 = torch.rand_like(a2)
    assert torch.equal(a.to_torch(), a2.to_torch()) and torch.equal(b.to_torch(), b2.to_torch())
    assert not torch.equal(a.to_torch(), b.to_torch())


def test_factories_give_the_same_values_on_every_layout(mesh1, mesh4, mesh2d):
    """1-D, 2-D, uneven (7 rows on 4 devices) and replicated: each device draws only the blocks of its shard."""
    layouts = [(mesh1, [Replicate()]), (mesh4, [Shard(0)]), (mesh4, [Shard(1)]), (mesh4, [Replicate()]),
               (mesh2d, [Shard(0), Shard(1)]), (mesh2d, [Shard(1), Replicate()])]
    for make in (dtorch.rand, dtorch.randn):
        values = []
        for mesh, placements in layouts:
            dtorch.manual_seed(5)
            values.append(make(7, 5, device_mesh=mesh, placements=placements).to_torch())
        for other in values[1:]:
            assert torch.equal(values[0], other)
        assert values[0].unique().numel() == 35


def test_dropout_and_init_on_shards_draw_and_move_only_shards(mesh4, cluster):
    """No replicated copy: each device draws the blocks of its own shard (a factory), then elementwise ops."""
    from dtorch_protocol import messages as m

    x = dtorch.distribute_tensor(torch.randn(64, 8), mesh4, [Shard(0)])
    w = dtorch.zeros(16, 64, device_mesh=mesh4, placements=[Shard(1)])
    sent, eager_emit = [], cluster.emit
    cluster.emit = lambda item: (sent.append(item), eager_emit(item))[1]
    try:
        y = F.dropout(x, p=0.25, training=True)
        torch.nn.init.uniform_(w, -1, 1)
        torch.nn.init.normal_(w, std=2.0)
    finally:
        cluster.emit = eager_emit
    assert not [i for i in sent if isinstance(i, m.InstrRedistribute)]
    assert [i.spec.placements for i in sent if isinstance(i, m.InstrCreate)] == [["S0"], ["S1"], ["S1"]]
    kept = y.to_torch() != 0
    assert 0.6 < kept.float().mean() < 0.9
    torch.testing.assert_close(y.to_torch()[kept], x.to_torch()[kept] / 0.75)
    assert 1.5 < w.to_torch().std() < 2.5


def test_torch_manual_seed_and_rng_state_govern_dtensor_random_values(mesh1):
    """Each random op draws its seed from torch's default generator: `torch.manual_seed` (transformers' `set_seed`)
    makes DTensor random values reproducible as plain ones, `torch.set_rng_state` resumes them, and a sampling
    generate of a tensor-parallel model repeats under one seed. DTorch had a stream of its own that only
    `dtorch.manual_seed` reset, so the same `torch.manual_seed` gave other values each time."""
    x = dtorch.distribute_tensor(torch.rand(4, 8) + 0.1, mesh1, [Shard(0)])

    def draw():
        return [t.full_tensor() for t in (F.dropout(x, 0.5), torch.rand_like(x), torch.multinomial(x, 3),
                                          dtorch.randn(4, 4, device_mesh=mesh1, placements=[Shard(1)]))]

    torch.manual_seed(5)
    first = draw()
    torch.manual_seed(5)
    again = draw()
    torch.manual_seed(6)
    other = draw()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, b) for a, b in zip(first[1:], other[1:]))
    saved = torch.get_rng_state()
    resumed = [draw(), draw()]
    torch.set_rng_state(saved)
    assert all(torch.equal(a, b) for one, two in zip(resumed, [draw(), draw()]) for a, b in zip(one, two))


def test_a_sampling_generate_repeats_under_transformers_set_seed(mesh1):
    transformers = pytest.importorskip("transformers")
    from dtorch.nn import hf_tp_plan, parallelize_module

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    tp = parallelize_module(model, mesh1, hf_tp_plan(model))
    ids = dtorch.distribute_tensor(torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(1)), mesh1,
                                   [Replicate()])
    runs = []
    for seed in (3, 3, 4):
        transformers.set_seed(seed)
        runs.append(tp.generate(ids, max_new_tokens=8, do_sample=True, top_k=20).full_tensor())
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recomputes_the_same_dropout_masks(mesh1, reentrant):
    """torch.utils.checkpoint restores torch's RNG state before it recomputes a forward, so dropout draws the same
    mask again. DTorch's seeds came from a stream of its own, which the restore did not reach: the recomputed masks
    differed, and the gradients were silently not those of the forward that ran."""
    from torch.utils.checkpoint import checkpoint

    from dtorch.nn import replicate_module

    torch.manual_seed(0)
    block = replicate_module(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.GELU(),
                                                 torch.nn.Linear(16, 8)), mesh1)
    x = dtorch.distribute_tensor(torch.randn(6, 8), mesh1, [Shard(0)])
    runs = []
    for run in (block, lambda v: checkpoint(block, v, use_reentrant=reentrant)):
        block.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        out = run(x.detach().requires_grad_(reentrant))
        out.pow(2).sum().backward()
        runs.append((out.full_tensor(), [p.grad.full_tensor() for p in block.parameters()]))
    (plain_out, plain_grads), (out, grads) = runs
    assert torch.equal(out, plain_out)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want)
