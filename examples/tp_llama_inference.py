"""Tensor-parallel inference of an unmodified Hugging Face Llama: the parallelism is a plan, not code.

    python3 examples/tp_llama_inference.py [--devices 2] [--layers 2] [--hidden 64]
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dtorch
from dtorch import Replicate
from dtorch.nn import llama_tp_plan, parallelize_module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()  # random weights: no download
    prompt = torch.randint(0, 256, (1, 6))
    expected = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)

    mesh = dtorch.DeviceMesh("cpu", list(range(args.devices)))
    parallelize_module(model, mesh, llama_tp_plan())  # a plan is data: name patterns -> styles
    tokens = model.generate(dtorch.distribute_tensor(prompt, mesh, [Replicate()]),
                            max_new_tokens=args.new_tokens, do_sample=False).to_torch()
    print(f"mesh: {mesh}")
    print(f"q_proj weight: {model.model.layers[0].self_attn.q_proj.weight.placements}")
    print(f"tokens (dtorch, {args.devices}-way TP): {tokens.tolist()[0]}")
    print(f"tokens (plain torch):            {expected.tolist()[0]}")
    print("identical" if torch.equal(tokens, expected) else "DIFFERENT")


if __name__ == "__main__":
    main()
