"""Expert parallelism for an unmodified Hugging Face Mixtral: experts sharded over a mesh dim, checked against torch.

    python3 examples/moe_expert_parallel.py [--model mixtral|qwen2_moe] [--ep 2] [--dp 2] [--steps 5]

The plan is data: `moe_ep_plan()` is `{"model.layers.*.mlp.experts": ExpertParallel()}`. transformers' own
routing (router, top-k, sort by expert, grouped matmuls, combine) runs on DTensors: each device computes only its
experts' rows, the tokens are gathered once per layer and the outputs reduced once.
"""

from __future__ import annotations

import argparse
import copy
import gc

import torch
import transformers

import dtorch
from dtorch import Replicate, Shard
from dtorch.nn import moe_ep_plan, parallelize_module


def tiny(model: str, **extra):
    common = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_experts_per_tok": 2, **extra}
    torch.manual_seed(0)
    if model == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(intermediate_size=64, num_local_experts=8,
                                                                          **common))
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8, **common))


def bytes_per_worker(session) -> dict[str, int]:
    gc.collect()
    session.sync()
    return {w.worker: w.bytes for w in dtorch.status().workers}


def _devices(worker: str, mesh: dtorch.DeviceMesh, session) -> int:
    """How many of the mesh's logical devices this session has on `worker`."""
    (status,) = [w for w in dtorch.status().workers if w.worker == worker]
    return sum(1 for d in status.devices if d.split(":")[0] == session.id and int(d.split(":")[1]) in mesh.devices)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["mixtral", "qwen2_moe"], default="mixtral")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=4)
    args = parser.parse_args()
    reference = tiny(args.model).eval()
    prompt = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))

    # inference, EP only: experts sharded over `ep`, the batch too (the attention is data parallel over it)
    session = dtorch.connect()
    mesh = dtorch.DeviceMesh("cpu", list(range(args.ep)), mesh_dim_names=("ep",))
    before = bytes_per_worker(session)
    model = parallelize_module(copy.deepcopy(reference), mesh, moe_ep_plan(), tp_mesh_dim="ep")
    after = bytes_per_worker(session)
    tensors = [*reference.named_parameters(), *reference.named_buffers()]
    sizes = {n: t.numel() * t.element_size() for n, t in tensors}
    experts = sum(size for n, size in sizes.items() if ".experts." in n)
    others = sum(sizes.values()) - experts  # replicated parameters and buffers: a copy per logical device
    per_worker = {w: after[w] - before.get(w, 0) - others * _devices(w, mesh, session) for w in after}
    print(f"mesh {mesh}; expert weights {model.model.layers[0].mlp.experts.gate_up_proj.placements} on 'ep'")
    print(f"expert weight bytes per worker: {per_worker} of {experts} in all")
    batch = dtorch.distribute_tensor(prompt, mesh, [Shard(0)] if prompt.shape[0] % args.ep == 0 else [Replicate()])
    with torch.no_grad():
        logits = model(batch).logits.to_torch()
        expected = reference(prompt).logits
    print(f"logits: max abs difference from plain torch {(logits - expected).abs().max().item():.2e}")
    tokens = model.generate(batch, max_new_tokens=args.new_tokens, do_sample=False).to_torch()
    want = reference.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
    print(f"greedy tokens {'identical' if torch.equal(tokens, want) else 'DIFFERENT'}: {tokens[0].tolist()}")

    # training, DP x EP with the router's auxiliary loss: the batch over both dims, experts over `ep`
    reference = tiny(args.model, output_router_logits=True, router_aux_loss_coef=0.05).train()
    grid = torch.arange(args.dp * args.ep).reshape(args.dp, args.ep).tolist()
    mesh = dtorch.DeviceMesh("cpu", grid, mesh_dim_names=("dp", "ep"))
    model = parallelize_module(copy.deepcopy(reference), mesh, moe_ep_plan(), tp_mesh_dim="ep")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
    data = torch.Generator().manual_seed(2)
    for step in range(args.steps):
        ids = torch.randint(0, 128, (args.dp * args.ep, 8), generator=data)
        out = reference(ids, labels=ids)
        ref_opt.zero_grad()
        out.loss.backward()
        ref_opt.step()
        batch = dtorch.distribute_tensor(ids, mesh, [Shard(0), Shard(0)])
        dout = model(batch, labels=batch)
        opt.zero_grad()
        dout.loss.backward()
        opt.step()
        print(f"step {step}  loss dtorch {dout.loss.item():.6f}  torch {out.loss.item():.6f}  "
              f"aux dtorch {dout.aux_loss.item():.6f}  torch {out.aux_loss.item():.6f}")


if __name__ == "__main__":
    main()
