"""Unmodified Hugging Face mixture-of-experts models under expert parallelism (EP), DP x EP and TP x EP.

The references are the same models in plain torch; expert weights are sharded over the `ep` mesh dim by
`ExpertParallel`, and transformers' own routing code runs on DTensors.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dtorch
from _helpers import tap, worker_bytes
from dtorch import Partial, Replicate, Shard, _dispatch
from dtorch.nn import ExpertParallel, llama_tp_plan, moe_ep_plan, parallelize_module
from dtorch_protocol import messages as m

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=1e-4, atol=1e-5)
NEW_TOKENS = 3
EP_PLAN = moe_ep_plan()


def tiny(kind: str, seed: int = 0, **extra):
    common = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_experts_per_tok": 2, "max_position_embeddings": 64, **extra}
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**{"intermediate_size": 32, "num_local_experts": 4, **common})
        cls = transformers.MixtralForCausalLM
    else:
        cfg = transformers.Qwen2MoeConfig(**{"intermediate_size": 64, "moe_intermediate_size": 32,
                                             "shared_expert_intermediate_size": 32, "num_experts": 4, **common})
        cls = transformers.Qwen2MoeForCausalLM
    torch.manual_seed(seed)
    return cls(cfg).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 96, (4, 7), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def reference(request, ids):
    model = tiny(request.param)
    with torch.no_grad():
        logits = model(ids).logits
    expected = model.generate(ids[:2], max_new_tokens=NEW_TOKENS, do_sample=False)
    return request.param, model, logits, expected


def ep_mesh(n: int):
    return dtorch.DeviceMesh("cpu", list(range(n)), mesh_dim_names=("ep",))


def check(model, logits, expected, mesh, ids, batch_placements):
    with torch.no_grad():
        out = model(dtorch.distribute_tensor(ids, mesh, batch_placements)).logits
    torch.testing.assert_close(out.to_torch(), logits, **TOL)
    got = model.generate(dtorch.distribute_tensor(ids[:2], mesh, batch_placements), max_new_tokens=NEW_TOKENS,
                         do_sample=False)
    assert got.to_torch().tolist() == expected.tolist()


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_logits_and_generation(reference, ids, cluster, ep):
    kind, ref, logits, expected = reference
    mesh = ep_mesh(ep)
    model = parallelize_module(copy.deepcopy(ref), mesh, EP_PLAN, tp_mesh_dim="ep")
    assert model.model.layers[0].mlp.experts.gate_up_proj.placements == (Shard(0),)
    check(model, logits, expected, mesh, ids, [Shard(0)] if ep == 2 else [Replicate()])


def test_dp_x_ep_and_tp_x_ep(reference, ids, cluster):
    kind, ref, logits, expected = reference
    dp_ep = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "ep"))
    model = parallelize_module(copy.deepcopy(ref), dp_ep, EP_PLAN, tp_mesh_dim="ep")
    check(model, logits, expected, dp_ep, ids, [Shard(0), Shard(0)])

    tp_ep = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("tp", "ep"))
    model = parallelize_module(copy.deepcopy(ref), tp_ep, llama_tp_plan(mlp=False), tp_mesh_dim="tp")
    parallelize_module(model, tp_ep, EP_PLAN, tp_mesh_dim="ep")
    assert model.model.layers[0].self_attn.q_proj.weight.placements == (Shard(0), Replicate())
    assert model.model.layers[0].mlp.experts.down_proj.placements == (Replicate(), Shard(0))
    check(model, logits, expected, tp_ep, ids, [Replicate(), Shard(0)])


def test_routing_runs_on_the_workers_and_exchanges_tokens_once(cluster, mesh1):
    """No sync point in an EP forward and backward; the tokens move once each way, the experts never."""
    ref = tiny("mixtral").model.layers[0].mlp
    block = parallelize_module(copy.deepcopy(ref), mesh1, {"experts": ExpertParallel()})
    x = torch.randn(2, 5, 32)
    before = {id(p) for p in _dispatch.planner.plans()}
    sent: list = []
    with tap(cluster, sent):
        dx = dtorch.distribute_tensor(x, mesh1, [Shard(0)]).requires_grad_()
        out = block(dx)
        moved = [i for i in sent if isinstance(i, m.InstrRedistribute)]
        assert out.placements[0].is_partial()  # combined where the next op needs it, not inside the block
        (out * out).sum().backward()
    token_moves = [i for i in moved if i.src_spec.shape == [10, 32]]
    assert [(i.src_spec.placements, i.dst_spec.placements) for i in token_moves] == [(["S0"], ["R"])]
    assert not any(i.src_spec.shape[0] == 4 and len(i.src_spec.shape) == 3 for i in moved)  # expert weights stay
    made = [p for p in _dispatch.planner.plans() if id(p) not in before]
    assert not [p.op_name for p in made if p.route in ("local", "sync")]  # nothing ran on the client
    with torch.no_grad():
        torch.testing.assert_close(out.to_torch(), ref(x), **TOL)


def test_all_tokens_routed_to_one_device(ids, cluster):
    """A router that sends every token to the same two experts: one device's experts get every row, the other's
    none."""
    mesh1 = ep_mesh(2)
    ref = tiny("mixtral").train()
    for layer in ref.model.layers:
        torch.nn.init.zeros_(layer.mlp.gate.weight)  # equal logits: top-2 picks experts 0 and 1 everywhere
    model = parallelize_module(copy.deepcopy(ref), mesh1, EP_PLAN, tp_mesh_dim="ep")
    loss = ref(ids, labels=ids).loss
    loss.backward()
    d = dtorch.distribute_tensor(ids, mesh1, [Shard(0)])
    dloss = model(d, labels=d).loss
    dloss.backward()
    torch.testing.assert_close(dloss.to_torch(), loss.detach(), **TOL)
    for name in ("gate_up_proj", "down_proj"):
        got = getattr(model.model.layers[1].mlp.experts, name).grad.to_torch()
        want = getattr(ref.model.layers[1].mlp.experts, name).grad
        torch.testing.assert_close(got, want, **TOL)
        assert [e for e in range(4) if not want[e].any()] in ([0, 1], [2, 3])  # one device's pair saw nothing
    torch.testing.assert_close(model.model.embed_tokens.weight.grad.to_torch(), ref.model.embed_tokens.weight.grad,
                               **TOL)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_weights_take_one_ep_th_of_the_bytes_per_device(cluster, ep):
    mesh = ep_mesh(ep)
    experts = tiny("mixtral").model.layers[0].mlp.experts
    total = sum(p.numel() * p.element_size() for p in experts.parameters())

    before = worker_bytes(cluster)
    parallelize_module(experts, mesh, ExpertParallel())
    after = worker_bytes(cluster)
    status = dtorch.status()
    devices = {w.worker: sum(1 for d in w.devices if d.startswith(f"{cluster.id}:") and
                             int(d.split(":")[1]) in mesh.devices) for w in status.workers}
    for worker, held in after.items():
        assert held - before.get(worker, 0) == total * devices[worker] // ep, (worker, devices)
    del experts


def test_twenty_adamw_steps_of_dp_x_ep_match_torch_including_the_aux_loss(cluster):
    ref = tiny("mixtral", num_hidden_layers=1, output_router_logits=True, router_aux_loss_coef=0.05).train()
    mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "ep"))
    model = parallelize_module(copy.deepcopy(ref), mesh, EP_PLAN, tp_mesh_dim="ep")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (model, ref))
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 96, (4, 8), generator=gen) for _ in range(4)]
    expected, got = [], []
    for step in range(20):
        ids = batches[step % 4]
        out = ref(ids, labels=ids)
        ref_opt.zero_grad()
        out.loss.backward()
        ref_opt.step()
        expected.append((out.loss.item(), out.aux_loss.item()))
        batch = dtorch.distribute_tensor(ids, mesh, [Shard(0), Shard(0)])
        dout = model(batch, labels=batch)
        opt.zero_grad()
        dout.loss.backward()
        opt.step()
        got.append((dout.loss, dout.aux_loss))
    got = [(loss.item(), aux.item()) for loss, aux in got]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert sum(loss for loss, _ in got[-4:]) < sum(loss for loss, _ in got[:4])  # it trained


def test_bad_expert_parallel_plans_say_what_was_expected(mesh1, mesh4):
    model = tiny("mixtral")
    with pytest.raises(ValueError, match=r"^ExpertParallel: 'model.layers.0.mlp.gate' \(MixtralTopKRouter\) has no "
                                         r"stacked expert weights.*'model.layers.\*.mlp.experts'$"):
        parallelize_module(model, mesh1, {"model.layers.*.mlp.gate": ExpertParallel()})
    three = tiny("mixtral", num_local_experts=3)
    with pytest.raises(ValueError, match=r"^ExpertParallel: 'model.layers.0.mlp.experts' has 3 experts, which mesh dim "
                                         r"0 of size 4 cannot split evenly; use a mesh dim whose size divides 3$"):
        parallelize_module(three, mesh4, EP_PLAN)
    eager = tiny("mixtral", experts_implementation="eager")
    with pytest.raises(ValueError, match=r"runs transformers' 'eager' experts.*experts_implementation='grouped_mm'"):
        parallelize_module(eager, mesh1, EP_PLAN)


def test_a_disjoint_partial_is_an_ordinary_partial_on_the_wire():
    from dtorch._disjoint import DisjointPartial

    p = DisjointPartial(routing=3, dim=0)
    assert p.to_wire() == "Psum" and p.is_partial() and p != Partial() and p.reduce_op == "sum"
