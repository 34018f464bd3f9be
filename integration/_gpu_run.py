"""GPU scenarios for integration/test_gpu.py, each in its own process (its own default session and cluster).

    python integration/_gpu_run.py MODE [--controller HOST:PORT]

MODE: ops (ops and a TP training run on a "cuda" mesh of the worker DTORCH_LOCAL_DEVICE names vs plain torch on the
CPU; integration/test_ops.py runs it on a CPU worker) | mixed (a cuda and a cpu
worker of a running controller: redistributions between them, dropout alike on either device type, a random
op on a replicated input refused) | collectives (every
lowered redistribution on 2 GPUs vs torch, bytes received per worker) | tp (a TP MLP forward and backward on 2
GPUs) | llama (DP x TP Llama training on 2 GPUs vs torch). Prints one JSON line; every wait is bounded.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.nn as nn

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.nn import ColwiseParallel, RowwiseParallel, parallelize_module


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def train_tp(mesh, steps: int = 5) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    ours, theirs = [], []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        loss = ((model(dtorch.distribute_tensor(x, mesh, [Replicate()])) - dtorch.distribute_tensor(
            y, mesh, [Replicate()])) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_loss = ((ref(x) - y) ** 2).mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        ours.append(loss.item())
        theirs.append(ref_loss.item())
    return ours, theirs


def ops(info: dict) -> None:
    dtorch.connect(workers=1)
    mesh = dtorch.DeviceMesh("cuda", [0, 1])  # two logical devices on the one worker
    a, b = torch.randn(12, 8), torch.randn(8, 6)
    da, db = dtorch.distribute_tensor(a, mesh, [Shard(0)]), dtorch.distribute_tensor(b, mesh, [Replicate()])
    info["device"], info["mesh"] = str(da.device), da.device_mesh.device_type  # the client's; where shards live
    info["matmul"] = err((da @ db).to_torch(), a @ b)
    info["softmax"] = err(torch.softmax(da, dim=-1).to_torch(), torch.softmax(a, dim=-1))
    info["sum"] = err(da.sum(dim=0).to_torch(), a.sum(dim=0))
    info["gather"] = err(da.redistribute(placements=[Replicate()]).to_torch(), a)
    # Partial reads: a small one combined on the client, one of 1 MiB or more on the worker first (to shards)
    c, d = torch.randn(1024, 256) / 16, torch.randn(256, 512) / 16
    dc, dd = dtorch.distribute_tensor(c, mesh, [Shard(1)]), dtorch.distribute_tensor(d, mesh, [Shard(0)])
    info["partial_read"] = max(err((dc @ dd).to_torch(), c @ d), err((dc[:8] @ dd).to_torch(), c[:8] @ d))
    ours, theirs = train_tp(mesh)  # backward in the client's autograd engine, with or without CUDA here
    info["train"] = max(abs(x - y) for x, y in zip(ours, theirs))
    info["device_types"] = sorted({w.device_type for w in dtorch.status().workers})  # a tenant sees those it uses


def mixed(info: dict, controller: str) -> None:
    dtorch.connect(controller)
    mesh = dtorch.DeviceMesh("cpu", [0, 1])  # one device on each worker: one cuda, one cpu
    x = torch.randn(10, 6)
    dx = dtorch.distribute_tensor(x, mesh, [Shard(0)])
    info["device_types"] = sorted(w.device_type for w in dtorch.status().workers)  # a tenant sees those it uses
    info["gather"] = err(dx.redistribute(placements=[Replicate()]).to_torch(), x)
    info["to_shard1"] = err(dx.redistribute(placements=[Shard(1)]).to_torch(), x)
    p = dtorch.ones(4, 3, device_mesh=mesh, placements=[Partial()])
    info["partial"] = err(p.redistribute(placements=[Replicate()]).to_torch(), torch.ones(4, 3))
    other = dtorch.DeviceMesh("cpu", [1, 0])
    info["cross_mesh"] = err(dx.redistribute(device_mesh=other, placements=[Shard(0)]).to_torch(), x)
    # dropout of a sharded tensor draws each shard's blocks on CPU generators: the same mask on either device type
    dtorch.manual_seed(7)
    drop = torch.nn.functional.dropout(dx, 0.5).to_torch()
    dtorch.manual_seed(7)
    swapped = torch.nn.functional.dropout(dx.redistribute(device_mesh=other, placements=[Shard(0)]), 0.5)
    kept = torch.where(drop != 0, x * 2, 0.0)  # p = 0.5: what is kept is doubled
    info["dropout"] = err(swapped.to_torch(), drop) + err(kept, drop)  # 0.0 when both hold
    info["dropped"] = int((drop == 0).sum())
    try:  # of a Partial tensor it runs replicated under one seed: each device type's generator would differ
        torch.nn.functional.dropout(p, 0.5).to_torch()
        info["random"] = "no error"
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        info["random"] = str(e)


def collectives(info: dict) -> None:
    dtorch.connect(workers=2)
    mesh = dtorch.DeviceMesh("cuda", [0, 1])
    x = torch.randn(9, 7)
    out = {}
    for name, src, dst in [("all_gather", [Shard(0)], [Replicate()]), ("all_to_all", [Shard(0)], [Shard(1)]),
                           ("slice", [Replicate()], [Shard(1)])]:
        out[name] = err(dtorch.distribute_tensor(x, mesh, src).redistribute(placements=dst).to_torch(), x)
    for op in ("sum", "avg", "max", "min"):
        p = dtorch.distribute_tensor(x, mesh, [Replicate()]).redistribute(placements=[Partial(op)])
        expected = {"sum": x, "avg": x, "max": x, "min": x}[op]
        out[f"all_reduce_{op}"] = err(p.redistribute(placements=[Replicate()]).to_torch(), expected)
        out[f"reduce_scatter_{op}"] = err(p.redistribute(placements=[Shard(0)]).to_torch(), expected)
    info["errors"] = out
    before = {w.worker: w.received_bytes for w in dtorch.status().workers}
    # four logical devices on the two GPUs: the pieces would pull 3 whole copies into each device (2 remote: 4
    # per worker), a group combines each worker's two locally first (1.5 x the size per worker)
    mesh4 = dtorch.DeviceMesh("cuda", [0, 1, 2, 3])
    big = dtorch.ones(1 << 20, device_mesh=mesh4, placements=[Partial()])
    big.redistribute(placements=[Replicate()])._session.sync()
    time.sleep(0.6)  # a report carries the counters
    info["received"] = {w.worker: w.received_bytes - before[w.worker] for w in dtorch.status().workers}


def tp(info: dict) -> None:
    dtorch.connect(workers=2)
    ours, theirs = train_tp(dtorch.DeviceMesh("cuda", [0, 1]))
    info["train"] = max(abs(x - y) for x, y in zip(ours, theirs))


def llama(info: dict) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dtorch.nn import llama_tp_plan

    dtorch.connect(workers=2)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(config)
    model = copy.deepcopy(ref)
    mesh = dtorch.DeviceMesh("cuda", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh, llama_tp_plan(), tp_mesh_dim="tp")
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(3):
        ids = torch.randint(0, 128, (4, 16), generator=data)
        loss = model(dtorch.distribute_tensor(ids, mesh, [Shard(0), Replicate()]), labels=dtorch.distribute_tensor(
            ids, mesh, [Shard(0), Replicate()])).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_loss = ref(ids, labels=ids).loss
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        worst = max(worst, abs(loss.item() - ref_loss.item()))
    info["train"] = worst


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["ops", "mixed", "collectives", "tp", "llama"])
    p.add_argument("--controller", default="")
    args = p.parse_args()
    info: dict = {"mode": args.mode}
    if args.mode == "mixed":
        mixed(info, args.controller)
    else:
        {"ops": ops, "collectives": collectives, "tp": tp, "llama": llama}[args.mode](info)
    dtorch.shutdown()
    print(json.dumps(info))


if __name__ == "__main__":
    main()
