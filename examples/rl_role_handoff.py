"""RL roles: a policy trained on a 2-way DP x 2-way TP mesh hands its weights to a differently sharded
inference mesh with one redistribute per parameter; generation there uses the new weights.

    python3 examples/rl_role_handoff.py
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dtorch
from dtorch import Replicate, Shard
from dtorch.nn import copy_weights, llama_tp_plan, parallelize_module


def main() -> None:
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    trainer_mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    inference_mesh = dtorch.DeviceMesh("cpu", [4, 5])  # other logical devices, 2-way TP
    policy = parallelize_module(LlamaForCausalLM(config), trainer_mesh, llama_tp_plan(), tp_mesh_dim="tp")
    sampler = parallelize_module(LlamaForCausalLM(config).eval(), inference_mesh, llama_tp_plan())

    prompt = torch.randint(0, 128, (1, 5))
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    for _ in range(3):  # a few "RL" updates of the policy
        batch = dtorch.distribute_tensor(torch.randint(0, 128, (2, 8)), trainer_mesh, [Shard(0), Replicate()])
        loss = policy(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()

    copy_weights(policy, sampler)  # trainer layout -> inference layout, worker to worker
    tokens = sampler.generate(dtorch.distribute_tensor(prompt, inference_mesh, [Replicate()]),
                              max_new_tokens=6, do_sample=False).to_torch()
    plain = LlamaForCausalLM(config).eval()
    plain.load_state_dict({k: v.to_torch() for k, v in policy.state_dict().items()})
    expected = plain.generate(prompt, max_new_tokens=6, do_sample=False)
    print(f"sampler q_proj: {sampler.model.layers[0].self_attn.q_proj.weight.device_mesh} "
          f"{sampler.model.layers[0].self_attn.q_proj.weight.placements}")
    print(f"generated with the trained weights: {tokens.tolist()[0]}")
    print("matches plain torch" if torch.equal(tokens, expected) else "DIFFERENT")


if __name__ == "__main__":
    main()
