"""Ready-made plans (plans are data): tensor parallelism for Llama-style Hugging Face decoders.

Works for any model whose module names follow transformers' Llama layout (Llama, Mistral, Qwen2, ...).
"""

from __future__ import annotations

from dtorch.nn.style import ColwiseParallel, ParallelStyle, RowwiseParallel
from dtorch_protocol.placement_types import Replicate


def llama_tp_plan() -> dict[str, ParallelStyle]:
    """Megatron-style TP: attention and MLP input projections column-wise, output projections row-wise."""
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
