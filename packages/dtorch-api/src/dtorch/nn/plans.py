"""Ready-made plans (plans are data): tensor parallelism for Llama-style Hugging Face decoders, expert
parallelism for their mixture-of-experts variants.

Works for any model whose module names follow transformers' Llama layout (Llama, Mistral, Qwen2, ...).
"""

from __future__ import annotations

from dtorch.nn.style import ColwiseParallel, ExpertParallel, ParallelStyle, RowwiseParallel
from dtorch_protocol.placement_types import Replicate


def llama_tp_plan(mlp: bool = True) -> dict[str, ParallelStyle]:
    """Megatron-style TP: attention and MLP input projections column-wise, output projections row-wise.

    `mlp=False` leaves the MLPs out, for mixture-of-experts models (Mixtral, Qwen2-MoE), whose experts take
    `moe_ep_plan()` on another mesh dim.
    """
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    if mlp:
        plan.update({"model.layers.*.mlp.gate_proj": ColwiseParallel(),
                     "model.layers.*.mlp.up_proj": ColwiseParallel(),
                     "model.layers.*.mlp.down_proj": RowwiseParallel()})
    return plan


def moe_ep_plan() -> dict[str, ParallelStyle]:
    """Expert parallelism for transformers' MoE decoders (Mixtral, Qwen2-MoE, ...): each layer's stacked experts
    sharded on the expert dim. Apply it with `tp_mesh_dim` naming the expert mesh dim."""
    return {"model.layers.*.mlp.experts": ExpertParallel()}
