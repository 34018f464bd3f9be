"""Data parallel x tensor parallel training of an unmodified Hugging Face Llama, checked against plain torch.

    python3 examples/dp_tp_training.py [--steps 10] [--graph]

--graph: the training step runs as a graph (`dtorch.compile(mode="graph")`: from its fourth call on its Python
does not run), with `dtorch.optim.AdamW`, whose step counters live on the workers.
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dtorch
from dtorch import Replicate, Shard
from dtorch.nn import llama_tp_plan, parallelize_module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--graph", action="store_true", help="run the step as a graph, with dtorch.optim.AdamW")
    args = parser.parse_args()
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config)
    model = copy.deepcopy(reference)

    mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh, llama_tp_plan(), tp_mesh_dim="tp")
    opt = (dtorch.optim.AdamW if args.graph else torch.optim.AdamW)(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)

    def train_step(batch: dtorch.DTensor) -> dtorch.DTensor:
        opt.zero_grad()
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    if args.graph:
        train_step = dtorch.compile(train_step, mode="graph")
    data = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        ids = torch.randint(0, 128, (4, 16), generator=data)
        batch = dtorch.distribute_tensor(ids, mesh, [Shard(0), Replicate()])  # batch split over dp
        loss = train_step(batch)

        ref_loss = reference(ids, labels=ids).loss
        ref_opt.zero_grad()
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        print(f"step {step:2d}  loss dtorch {loss.item():.6f}  torch {ref_loss.item():.6f}")
    if args.graph:
        print(f"{train_step.graphed} of {args.steps} steps ran as a graph")


if __name__ == "__main__":
    main()
