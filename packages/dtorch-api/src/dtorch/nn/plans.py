"""Ready-made plans (plans are data): tensor parallelism for Llama-style Hugging Face decoders (any model whose module
names follow transformers' Llama layout: Llama, Mistral, Qwen2, ...), the plan any transformers model ships
(`hf_tp_plan`), expert parallelism for their mixture-of-experts variants, and tensor and sequence parallelism for
diffusers' SD3 and FLUX transformers.
"""

from __future__ import annotations

import fnmatch
import warnings
from typing import Any

from dtorch.nn.style import (
    ColwiseParallel,
    ExpertParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from dtorch_protocol.placement_types import Replicate, Shard


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


# transformers' style names (`model.tp_plan` values) -> DTorch's style. DTensors keep global semantics, so a style
# that only changes where a layer's shards live (unit_colwise, packed_colwise) is the plain one; None: replicated
# (`replicate` and friends ask for nothing else). A name missing here is left replicated, with a warning.
HF_STYLES: dict[str, ParallelStyle | None] = {
    "colwise": ColwiseParallel(),
    "unit_colwise": ColwiseParallel(),
    "packed_colwise": ColwiseParallel(),
    "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
    "rowwise": RowwiseParallel(),
    "rowwise_rep": RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": ColwiseParallel(output_layouts=Replicate()),
    "sequence_parallel": SequenceParallel(),
    "replicate": None,
    "replicated_with_grad_allreduce": None,
    "local_params": None,
}


def hf_tp_plan(model: Any) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan a transformers model ships (`model.tp_plan`: its config's `base_model_tp_plan` plus
    the head's), as DTorch styles: `parallelize_module(model, mesh, hf_tp_plan(model))`.

    Entries DTorch cannot take as they are stay replicated, which changes where the work runs, never the results;
    a warning names them: styles with no DTorch counterpart (`mla_kv_a_proj`, `moe_tp_experts`, ...), entries
    that name a parameter rather than a module, and entries on modules other than nn.Linear and nn.Embedding.
    """
    import torch.nn as nn

    hf_plan = getattr(model, "tp_plan", None)
    if not isinstance(hf_plan, dict):
        raise TypeError(f"hf_tp_plan takes a transformers model (one with a `tp_plan` dict), "
                        f"got {type(model).__name__}")
    modules = dict(model.named_modules())
    plan: dict[str, ParallelStyle] = {}
    left: list[str] = []
    for pattern, name in hf_plan.items():
        if name in HF_STYLES and HF_STYLES[name] is None:
            continue
        style = HF_STYLES.get(name)
        matched = [m for n, m in modules.items() if fnmatch.fnmatchcase(n, pattern)]
        if not matched and not any(fnmatch.fnmatchcase(n, pattern) for n, _ in model.named_parameters()):
            continue  # an entry for a variant of the architecture this model is not (transformers skips it too)
        if style and matched and (isinstance(style, SequenceParallel)
                                  or all(isinstance(m, (nn.Linear, nn.Embedding)) for m in matched)):
            plan[pattern] = style
        else:
            left.append(f"{pattern} ({name})")
    if left:
        warnings.warn(f"hf_tp_plan: {type(model).__name__} keeps these entries of its tp_plan replicated (no DTorch "
                      f"style takes them as they are): {', '.join(left)}", stacklevel=2)
    return plan


def moe_ep_plan() -> dict[str, ParallelStyle]:
    """Expert parallelism for transformers' MoE decoders (Mixtral, Qwen2-MoE, ...): each layer's stacked experts
    sharded on the expert dim. Apply it with `tp_mesh_dim` naming the expert mesh dim."""
    return {"model.layers.*.mlp.experts": ExpertParallel()}


# ------------------------------------------------------------------ diffusion transformers (diffusers' module names)

_JOINT_IN = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
             "ff.net.0.proj", "ff_context.net.0.proj")
_JOINT_OUT = ("attn.to_out.0", "attn.to_add_out", "ff.net.2", "ff_context.net.2")


def sd3_tp_plan() -> dict[str, ParallelStyle]:
    """TP for SD3's `SD3Transformer2DModel` (and FLUX's double-stream blocks): both streams' attention and MLP
    input linears column-wise, output linears row-wise; activations replicated between blocks."""
    plan: dict[str, ParallelStyle] = {f"transformer_blocks.*.{name}": ColwiseParallel() for name in _JOINT_IN}
    plan.update({f"transformer_blocks.*.{name}": RowwiseParallel() for name in _JOINT_OUT})
    return plan


def flux_tp_plan() -> dict[str, ParallelStyle]:
    """TP for FLUX's `FluxTransformer2DModel`: `sd3_tp_plan()` for the double-stream blocks, and in the
    single-stream blocks the attention and MLP input linears column-wise, the shared output linear row-wise."""
    plan = sd3_tp_plan()
    for name in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"):
        plan[f"single_transformer_blocks.*.{name}"] = ColwiseParallel()
    plan["single_transformer_blocks.*.proj_out"] = RowwiseParallel()
    return plan


def sd3_sp_plan() -> dict[str, ParallelStyle]:
    """Sequence parallelism for SD3: the image tokens sharded from the patch embedding on (`Shard(1)`). Joint
    attention keeps each device's query rows and gathers keys and values (`dtorch._joint`); the text stays
    replicated. Linears over sequence-sharded rows need one sample per device: put the guidance halves on
    another mesh dim first (`sd3_cfg_plan()`)."""
    return {"pos_embed": PrepareModuleOutput(desired_output_layouts=Shard(1))}


def sd3_cfg_plan() -> dict[str, ParallelStyle]:
    """Classifier-free guidance in parallel: the transformer's batch (negative and positive halves) `Shard(0)`."""
    names = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")
    return {"": PrepareModuleInput(desired_input_kwarg_layouts={name: Shard(0) for name in names})}


def flux_sp_plan() -> dict[str, ParallelStyle]:
    """Sequence parallelism for FLUX: image tokens sharded from the input embedding on; joint attention as in
    `sd3_sp_plan()`; each single-stream block shards the joint sequence it concatenates (text and image)."""
    return {"x_embedder": PrepareModuleInput(desired_input_layouts=Shard(1)),
            "single_transformer_blocks.*.norm": PrepareModuleInput(desired_input_layouts=Shard(1))}
