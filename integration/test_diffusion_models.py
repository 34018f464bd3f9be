"""Unmodified diffusers pipelines (SD3, FLUX): the whole denoising loop with the transformer tensor- or
sequence-parallel and the VAE replicated, against the same pipelines in plain torch.

The components and plans are the example's (`examples/diffusion_sequence_parallel.py`).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

import dtorch
from _helpers import tap
from dtorch import Replicate
from dtorch_protocol import messages as m

pytest.importorskip("diffusers")
_path = Path(__file__).resolve().parents[1] / "examples" / "diffusion_sequence_parallel.py"
_spec = importlib.util.spec_from_file_location("diffusion_sequence_parallel", _path)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

STEPS = 2
TOL = dict(rtol=1e-4, atol=1e-5)
FLASH = "aten._scaled_dot_product_flash_attention_for_cpu.default"


@pytest.fixture(scope="module", params=["sd3", "flux"])
def reference(request):
    model = request.param
    pipe = example.tiny_sd3() if model == "sd3" else example.tiny_flux()
    tensors = example.inputs(model)
    latents = example.call(pipe, model, tensors, STEPS, output_type="latent")
    images = example.call(pipe, model, tensors, STEPS)
    return model, pipe, tensors, latents, images


def denoise(reference, plan):
    """Run the pipeline under `plan`; returns its latents and images and the transformer's attention calls."""
    model, pipe, tensors, _, _ = reference
    mesh = example.mesh_for(model, plan)
    pipe = example.parallelize(copy.deepcopy(pipe), model, plan, mesh)
    replicate = [Replicate()] * mesh.ndim
    dtensors = {k: dtorch.distribute_tensor(v, mesh, replicate) for k, v in tensors.items()}
    session = next(iter(dtensors.values()))._session
    sent: list = []
    spans: list = []  # the transformer's own instructions only (the VAE has an attention too)
    pipe.transformer.register_forward_pre_hook(lambda *_: spans.append([len(sent)]))
    pipe.transformer.register_forward_hook(lambda *_: spans[-1].append(len(sent)))
    with tap(session, sent):
        latents = example.call(pipe, model, dtensors, STEPS, output_type="latent")
        images = example.call(pipe, model, dtensors, STEPS)
    attention = [i for a, b in spans for i in sent[a:b] if isinstance(i, m.InstrCall) and i.op == FLASH]
    return mesh, latents, images, attention


def test_tensor_parallel_transformer(reference, cluster):
    model, _, _, latents, images = reference
    mesh, got_latents, got_images, attention = denoise(reference, "tp")
    torch.testing.assert_close(got_latents.to_torch(), latents, **TOL)
    torch.testing.assert_close(got_images.to_torch(), images, **TOL)
    assert attention and all(call.outs[0].spec.placements[-1] == "S1" for call in attention)  # heads split


def test_sequence_parallel_transformer_attends_with_its_own_query_rows(reference, cluster):
    model, _, _, latents, images = reference
    mesh, got_latents, got_images, attention = denoise(reference, "sp")
    torch.testing.assert_close(got_latents.to_torch(), latents, **TOL)
    torch.testing.assert_close(got_images.to_torch(), images, **TOL)
    sp = mesh.mesh_dim_names.index("sp")
    # every attention kernel ran on the device's own query rows (queries sharded on the sequence), keys gathered
    assert attention and all(call.outs[0].spec.placements[sp] == "S2" for call in attention)
    assert len(attention) == 2 * STEPS * (2 if model == "sd3" else 3)  # both pipeline calls, every block
