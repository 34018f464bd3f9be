"""Unmodified diffusers pipelines (SD3 and FLUX) with their transformer tensor- or sequence-parallel, vs plain torch.

    python3 examples/diffusion_sequence_parallel.py [--model sd3|flux|both] [--plan tp|sp|both] [--steps 3]

Components are built from small configs with random weights (no downloads); `prompt_embeds` stand in for the text
encoders. The denoising loop is the pipeline's own: its latents and prompt embeddings are DTensors, so every op
of the loop, the scheduler's included, runs on the workers.

Plans (data, `dtorch.nn.plans`):
  tp   attention and MLP linears column- then row-parallel (heads split), activations replicated between blocks
  sp   sequence parallel: image tokens sharded, each device attends with its own queries to gathered keys and
       values (`dtorch._joint`); for SD3 the two classifier-free-guidance halves also go to two devices each
The VAE decodes replicated on the mesh.
"""

from __future__ import annotations

import argparse
import copy

import torch

import dtorch
from dtorch import Replicate
from dtorch.nn import parallelize_module, replicate_module
from dtorch.nn.plans import flux_sp_plan, flux_tp_plan, sd3_cfg_plan, sd3_sp_plan, sd3_tp_plan

SIZE = 32  # image side in pixels: 16x16 latents, 64 image tokens after 2x2 patches


def tiny_vae(latent_channels: int):
    from diffusers import AutoencoderKL

    return AutoencoderKL(sample_size=SIZE, in_channels=3, out_channels=3, block_out_channels=(8, 8),
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4,
                         use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)


def tiny_sd3(seed: int = 0):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(sample_size=SIZE // 2, patch_size=2, in_channels=4, num_layers=2,
                                        attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                                        joint_attention_dim=32, pooled_projection_dim=16, out_channels=4,
                                        pos_embed_max_size=32)
    encoders = {f"{kind}{suffix}": None for kind in ("text_encoder", "tokenizer") for suffix in ("", "_2", "_3")}
    return StableDiffusion3Pipeline(transformer=transformer, vae=tiny_vae(4),
                                    scheduler=FlowMatchEulerDiscreteScheduler(), **encoders)


def tiny_flux(seed: int = 0):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    return FluxPipeline(transformer=transformer, vae=tiny_vae(4), scheduler=FlowMatchEulerDiscreteScheduler(),
                        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)


def inputs(model: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """Prompt embeddings (what the text encoders would give) and starting latents."""
    g = torch.Generator().manual_seed(seed)
    if model == "sd3":
        embeds, pooled = torch.randn(1, 8, 32, generator=g), torch.randn(1, 16, generator=g)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled,
                "negative_prompt_embeds": torch.zeros_like(embeds),
                "negative_pooled_prompt_embeds": torch.zeros_like(pooled),
                "latents": torch.randn(1, 4, SIZE // 2, SIZE // 2, generator=g)}
    return {"prompt_embeds": torch.randn(1, 8, 32, generator=g),
            "pooled_prompt_embeds": torch.randn(1, 32, generator=g),
            "latents": torch.randn(1, (SIZE // 4) ** 2, 16, generator=g)}  # FLUX packs 2x2 latent patches


def call(pipe, model: str, tensors: dict, steps: int, output_type: str = "pt"):
    extra = {"guidance_scale": 2.0} if model == "sd3" else {"guidance_scale": 3.5}
    return pipe(**tensors, num_inference_steps=steps, height=SIZE, width=SIZE, output_type=output_type, **extra).images


def parallelize(pipe, model: str, plan: str, mesh: dtorch.DeviceMesh):
    """Lay the pipeline out on `mesh`: the transformer by `plan`, the VAE replicated."""
    if plan == "tp":
        parallelize_module(pipe.transformer, mesh, sd3_tp_plan() if model == "sd3" else flux_tp_plan(),
                           tp_mesh_dim="tp")
    elif model == "sd3":  # the two guidance halves on the "cfg" mesh dim, image tokens on "sp"
        parallelize_module(pipe.transformer, mesh, sd3_cfg_plan(), tp_mesh_dim="cfg")
        parallelize_module(pipe.transformer, mesh, sd3_sp_plan(), tp_mesh_dim="sp")
    else:
        parallelize_module(pipe.transformer, mesh, flux_sp_plan(), tp_mesh_dim="sp")
    replicate_module(pipe.vae, mesh)
    return pipe


def mesh_for(model: str, plan: str) -> dtorch.DeviceMesh:
    if plan == "sp" and model == "sd3":
        return dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("cfg", "sp"))
    return dtorch.DeviceMesh("cpu", [0, 1], mesh_dim_names=(plan,))


def run(model: str, plan: str, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(images from DTorch, images from plain torch) for one model and plan."""
    reference = tiny_sd3() if model == "sd3" else tiny_flux()
    pipe = copy.deepcopy(reference)
    tensors = inputs(model)
    expected = call(reference, model, tensors, steps)
    mesh = mesh_for(model, plan)
    parallelize(pipe, model, plan, mesh)
    replicate = [Replicate()] * mesh.ndim
    got = call(pipe, model, {k: dtorch.distribute_tensor(v, mesh, replicate) for k, v in tensors.items()}, steps)
    return got.to_torch(), expected


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["sd3", "flux", "both"], default="both")
    parser.add_argument("--plan", choices=["tp", "sp", "both"], default="both")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    for model in ["sd3", "flux"] if args.model == "both" else [args.model]:
        for plan in ["tp", "sp"] if args.plan == "both" else [args.plan]:
            got, expected = run(model, plan, args.steps)
            err = (got - expected).abs().max().item()
            print(f"{model} {plan}: images {tuple(got.shape)}, max abs difference from plain torch {err:.2e}")


if __name__ == "__main__":
    main()
