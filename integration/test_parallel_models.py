"""Unmodified models under DP, TP, DP x TP, FSDP and PP: logits and training losses equal to plain torch."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dtorch
from _helpers import worker_bytes
from dtorch import Partial, Replicate, Shard
from dtorch.debug import CommDebugMode
from dtorch.nn import (
    ColwiseParallel,
    RowwiseParallel,
    copy_weights,
    fully_shard,
    hf_tp_plan,
    llama_tp_plan,
    loss_parallel,
    microbatch_forward,
    parallelize_module,
    place_on_mesh,
    replicate_module,
)

transformers = pytest.importorskip("transformers")

LLAMA_TP_PLAN = llama_tp_plan()
TOL = dict(rtol=1e-4, atol=1e-5)


def tiny_llama(seed: int = 0):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def reference():
    model = tiny_llama()
    ids = torch.randint(0, 96, (4, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    return model, ids, logits


def clone(model):
    fresh = tiny_llama(seed=123)
    fresh.load_state_dict(model.state_dict())  # a full torch state dict: sharded automatically
    return fresh


def test_llama_tensor_parallel_logits_and_generation(reference, mesh1):
    model, ids, logits = reference
    tp = parallelize_module(clone(model), mesh1, LLAMA_TP_PLAN)
    assert tp.model.layers[0].mlp.up_proj.weight.placements == (Shard(0),)
    assert tp.model.layers[0].mlp.down_proj.weight.placements == (Shard(1),)
    with torch.no_grad():
        out = tp(ids).logits
    torch.testing.assert_close(out.to_torch(), logits, **TOL)
    expected = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
    got = tp.generate(dtorch.distribute_tensor(ids[:1], mesh1, [Replicate()]), max_new_tokens=6, do_sample=False)
    assert got.to_torch().tolist() == expected.tolist()
    # beam search writes the DTensor ids into plain buffers it makes (`running_sequences[:, :, :n] = ids`)
    expected = model.generate(ids[:2], max_new_tokens=4, num_beams=2, do_sample=False)
    got = tp.generate(dtorch.distribute_tensor(ids[:2], mesh1, [Replicate()]), max_new_tokens=4, num_beams=2,
                      do_sample=False)
    got = got.to_torch() if isinstance(got, dtorch.DTensor) else got
    assert got.tolist() == expected.tolist()
    state = tp.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(state.to_torch(), model.state_dict()["model.layers.1.self_attn.q_proj.weight"])


def test_llama_dp_and_dp_x_tp(reference, mesh4, mesh2d):
    model, ids, logits = reference
    dp = replicate_module(clone(model), mesh4)
    with torch.no_grad():
        out = dp(dtorch.distribute_tensor(ids, mesh4, [Shard(0)])).logits
    torch.testing.assert_close(out.to_torch(), logits, **TOL)
    dptp = parallelize_module(clone(model), mesh2d, LLAMA_TP_PLAN, tp_mesh_dim="tp")
    with torch.no_grad():
        out = dptp(dtorch.distribute_tensor(ids, mesh2d, [Shard(0), Replicate()])).logits
    torch.testing.assert_close(out.to_torch(), logits, **TOL)
    assert out.to_torch().argmax(-1).tolist() == logits.argmax(-1).tolist()
    expected = model.generate(ids[:2], max_new_tokens=4, do_sample=False)
    got = dptp.generate(dtorch.distribute_tensor(ids[:2], mesh2d, [Shard(0), Replicate()]), max_new_tokens=4,
                        do_sample=False)
    assert got.to_torch().tolist() == expected.tolist()


def test_llama_pipeline_stages_with_microbatches(reference, cluster):
    model, ids, logits = reference
    stage0, stage1 = dtorch.DeviceMesh("cpu", [0]), dtorch.DeviceMesh("cpu", [1])
    pp = place_on_mesh(clone(model), {"model.embed_tokens": stage0, "model.rotary_emb": stage0,
                                      "model.layers.0": stage0, "model.layers.1": stage1,
                                      "model.norm": stage1, "lm_head": stage1})
    assert pp.model.layers[1].mlp.up_proj.weight.device_mesh == stage1
    with torch.no_grad():
        out = microbatch_forward(pp, dtorch.distribute_tensor(ids, stage0, [Replicate()]), microbatches=2)
    assert out.device_mesh == stage1
    torch.testing.assert_close(out.to_torch(), logits, **TOL)
    expected = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    got = pp.generate(dtorch.distribute_tensor(ids[:1], stage0, [Replicate()]), max_new_tokens=4, do_sample=False)
    assert got.to_torch().tolist() == expected.tolist()


@pytest.mark.parametrize("optimizer", ["adamw_foreach", "sgd_momentum"])
def test_pipeline_training_with_clipping_and_a_foreach_optimizer_matches_torch(cluster, optimizer):
    """An optimizer or `clip_grad_norm_` over parameters on several stage meshes runs each foreach op over lists
    that span the meshes; DTorch moved every list onto the first tensor's mesh, so the in-place updates of the
    other stages' parameters went into copies (AdamW's foreach step left them as they were: parameters off by the
    learning rate after one step) and clipping scaled copies of their gradients. Each mesh now gets its own call."""
    stage0, stage1 = dtorch.DeviceMesh("cpu", [0]), dtorch.DeviceMesh("cpu", [1])
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    pp = place_on_mesh(copy.deepcopy(ref), {"0": stage0, "1": stage0, "2": stage1, "3": stage1, "4": stage1})
    make = {"adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
            "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True)}[optimizer]
    ref_opt, opt = make(ref.parameters()), make(pp.parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        nn.functional.cross_entropy(ref(x), y).backward()
        want_norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        out = microbatch_forward(pp, dtorch.distribute_tensor(x, stage0, [Replicate()]), microbatches=2)
        nn.functional.cross_entropy(out, dtorch.distribute_tensor(y, stage1, [Replicate()])).backward()
        got_norm = nn.utils.clip_grad_norm_(pp.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(got_norm.full_tensor(), want_norm)
    for (name, want), got in zip(ref.named_parameters(), pp.parameters()):
        assert got.device_mesh == (stage0 if name.startswith("0") else stage1)
        torch.testing.assert_close(got.full_tensor(), want.detach(), **TOL, msg=name)


def test_a_vocabulary_parallel_head_trains_as_torch_with_its_logits_never_gathered(mesh1):
    """torch's recipe for a vocabulary-parallel loss (`"lm_head": ColwiseParallel()`, whose logits stay Shard(-1),
    and `loss_parallel()`) on an unmodified Llama: transformers' own loss over sharded logits, training and greedy
    generation as torch's, the logits sharded throughout."""
    model = tiny_llama()
    tp = parallelize_module(clone(model), mesh1, {**LLAMA_TP_PLAN, "lm_head": ColwiseParallel()})
    ref_opt, opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(tp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(3, 96, (4, 9), generator=gen)
        labels = ids.clone()
        labels[0, :3] = -100
        expected = model(input_ids=ids, labels=labels)
        expected.loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with loss_parallel():
            got = tp(input_ids=dtorch.distribute_tensor(ids, mesh1, [Replicate()]),
                     labels=dtorch.distribute_tensor(labels, mesh1, [Replicate()]))
            got.loss.backward()
        opt.step()
        opt.zero_grad()
        assert got.logits.placements == (Shard(2),)
        torch.testing.assert_close(got.loss.full_tensor(), expected.loss, **TOL)
    for (name, want), param in zip(model.named_parameters(), tp.parameters()):
        torch.testing.assert_close(param.full_tensor(), want.detach(), **TOL, msg=name)
    ids = torch.randint(3, 96, (2, 5), generator=gen)
    assert tp.generate(dtorch.distribute_tensor(ids, mesh1, [Replicate()]), max_new_tokens=4,
                       do_sample=False).full_tensor().tolist() == \
        model.generate(ids, max_new_tokens=4, do_sample=False).tolist()


def test_another_architecture_gpt2_tensor_parallel(mesh1):
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits
    dmodel = transformers.GPT2LMHeadModel(cfg).eval()
    dmodel.load_state_dict(model.state_dict())
    replicate_module(dmodel, mesh1)  # GPT-2 uses Conv1D, not nn.Linear: replicated, still unmodified code
    with torch.no_grad():
        out = dmodel(dtorch.distribute_tensor(ids, mesh1, [Shard(0)])).logits
    torch.testing.assert_close(out.to_torch(), expected, **TOL)


# Families whose shipped plans use different transformers styles: plain colwise/rowwise (Gemma 3), fused projections
# gathered and split again (Phi-3: colwise_gather_output, rowwise_split_input), gathered q/k/v (OLMo 2), and
# multi-head latent attention, whose mla_kv_a_proj has no DTorch style and stays replicated (DeepSeek-V3).
HF_FAMILIES = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}, None),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, None),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, None),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                         first_k_dense_replace=1, n_group=1, topk_group=1), "kv_a_proj_with_mqa (mla_kv_a_proj)"),
}


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_the_tensor_parallel_plan_a_transformers_model_ships_trains_as_torch(mesh1, family):
    config_name, model_name, extra, replicated = HF_FAMILIES[family]
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = getattr(transformers, config_name)(**{**sizes, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = hf_tp_plan(model)
    said = [str(w.message) for w in caught if "hf_tp_plan" in str(w.message)]
    assert said == ([f"hf_tp_plan: {model_name} keeps these entries of its tp_plan replicated (no DTorch style takes "
                     f"them as they are): model.layers.*.self_attn.{replicated}"] if replicated else [])
    assert plan and all(isinstance(style, (ColwiseParallel, RowwiseParallel)) for style in plan.values())
    tp = parallelize_module(copy.deepcopy(model), mesh1, plan)
    assert tp.lm_head.weight.placements == (Shard(0),)
    ids = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    ref_opt, opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(tp.parameters(), lr=0.1)
    for _ in range(2):
        expected = model(input_ids=ids, labels=ids)
        expected.loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        dids = dtorch.distribute_tensor(ids, mesh1, [Replicate()])
        got = tp(input_ids=dids, labels=dids)
        got.loss.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(got.logits.full_tensor(), expected.logits, **TOL)
    generated = tp.generate(dtorch.distribute_tensor(ids[:, :4], mesh1, [Replicate()]), max_new_tokens=4,
                            do_sample=False)
    assert generated.full_tensor().tolist() == model.generate(ids[:, :4], max_new_tokens=4, do_sample=False).tolist()


@pytest.mark.parametrize("layout", ["dp", "fsdp", "tp"])
def test_tied_embeddings_stay_one_parameter_and_train_as_torch(mesh1, layout, tmp_path):
    """GPT-2 ties its output projection to its input embedding: every layout keeps the one parameter (each use got a
    copy of its own, trained apart: losses 3.6e-3 off torch's after three steps), and training follows torch's.
    `save_pretrained` writes the trained weights, tied, for a plain `from_pretrained` (safetensors refused
    DTensors: "invalid python storage"), and a copy of the model saves its own."""
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg)
    model = copy.deepcopy(ref)
    lay_out = {"dp": lambda m: replicate_module(m, mesh1), "fsdp": lambda m: fully_shard(m, mesh1),
               "tp": lambda m: parallelize_module(m, mesh1, {"lm_head": ColwiseParallel()})}[layout]
    lay_out(model)
    assert len(list(model.parameters())) == len(list(ref.parameters()))
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(0))
    dids = dtorch.distribute_tensor(ids, mesh1, [Replicate() if layout == "tp" else Shard(0)])
    opt, dopt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        for m, o, x in ((ref, opt, ids), (model, dopt, dids)):
            m(input_ids=x, labels=x).loss.backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(model(input_ids=dids, labels=dids).loss.item(),
                               ref(input_ids=ids, labels=ids).loss.item(), **TOL)
    model.save_pretrained(tmp_path / "trained")
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.transformer.wte.weight.zero_()
    other.save_pretrained(tmp_path / "zeroed")
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "trained")
    for (key, want), got in zip(ref.state_dict().items(), saved.state_dict().values()):
        torch.testing.assert_close(got, want, **TOL, msg=key)
    assert saved.lm_head.weight is saved.transformer.wte.weight
    zeroed = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "zeroed")
    assert not zeroed.lm_head.weight.any() and model.transformer.wte.weight.full_tensor().any()


def _train(model, opt, batches, step_input):
    losses = []
    for x, y in batches:
        loss = ((model(step_input(x)) - step_input(y)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("layout", ["dp_x_tp", "fsdp", "torchtitan_tp_then_fsdp_on_slices",
                                    "torchtitan_fsdp_on_a_flattened_slice", "hsdp"])
def test_training_matches_single_process(mesh2d, layout):
    mesh, place = mesh2d, None
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    model.load_state_dict(ref.state_dict())
    comm = contextlib.nullcontext()
    if layout == "dp_x_tp":
        parallelize_module(model, mesh2d, {"0": ColwiseParallel(), "2": RowwiseParallel()}, tp_mesh_dim="tp")
    elif layout == "torchtitan_tp_then_fsdp_on_slices":
        # torch's FSDP2 + TP recipe, where each rank passes its own slices: the whole mesh's dims here (they were
        # the slices through coordinate 0: devices 0-1 for TP, 0 and 2 for FSDP, and activations moved between)
        parallelize_module(model, mesh2d["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh2d["dp"])
        assert model[0].weight.device_mesh == mesh2d and model[0].weight.placements == (Shard(0), Shard(0))
        assert model[2].weight.placements == (Shard(0), Shard(1))
        comm = CommDebugMode()
    elif layout == "torchtitan_fsdp_on_a_flattened_slice":  # FSDP over dp x cp, as torchtitan's "dp_shard_cp"
        mesh = dtorch.DeviceMesh("cpu", torch.arange(8).reshape(2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
        assert model[0].weight.device_mesh == mesh and model[0].weight.placements == (Shard(0), Shard(0), Shard(0))
        assert model[2].weight.placements == (Shard(0), Shard(0), Shard(1))
        comm = CommDebugMode()
    elif layout == "hsdp":  # torch's fully_shard on a 2-D mesh: replicated over dim 0, sharded over dim 1
        fully_shard(model, mesh=mesh2d)
        assert model[0].weight.placements == (Replicate(), Shard(0))
        comm = CommDebugMode()
        place = [Shard(0), Shard(0)]
    else:
        fully_shard(model, mesh2d, mesh_dim="dp")
        # as with torch's FSDP2: the model's parameters under the model's names, sharded outside the forward
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
        assert isinstance(model[0].weight, nn.Parameter) and model[0].weight.placements[0] == Shard(0)
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(5)]
    expected = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), batches, lambda t: t)
    with comm:
        got = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches,
                     lambda t: dtorch.distribute_tensor(t, mesh, place or [Shard(0)] + [Replicate()] * (mesh.ndim - 1)))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    if isinstance(comm, CommDebugMode):  # gradients reduce-scattered, nothing moved between meshes
        counts = comm.get_comm_counts()
        assert "point_to_point" not in counts and counts[torch.ops.c10d_functional.reduce_scatter_tensor] > 0
    for p, r in zip(model.parameters(), ref.parameters()):  # the last step's gradients, laid out as the parameters
        assert p.grad.placements == p.placements
        torch.testing.assert_close(p.grad.to_torch(), r.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("load", ["copy", "assign", "assign_dtensors"])
@pytest.mark.parametrize("layout", ["tp", "fsdp_blocks_then_root", "tp_x_fsdp"])
def test_a_model_built_on_the_meta_device_is_laid_out_loaded_and_trained_as_torch(mesh1, mesh2d, layout, load):
    """The way to build a model too large for one host (torchtitan's, FSDP2's): on the meta device, laid out, then
    `to_empty` and a checkpoint loaded. distribute_tensor could not copy out of a meta tensor; and fully_shard per
    block and then on the root (FSDP2's pattern) gathered the blocks' parameters twice, leaving them gathered after
    the forward: the optimizer stepped the shards while the forward kept reading the stale gathered copies.
    `load_state_dict(..., assign=True)` (torch's recipe: of tensors laid out as the parameters, or of plain ones)
    put plain parameters in the model, or DTensor ones without what the layout gives its own."""
    ref = tiny_llama()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(ref.config)
    if layout == "tp":
        parallelize_module(model, mesh1, hf_tp_plan(model))
    else:
        if layout == "fsdp_blocks_then_root":
            shard = functools.partial(fully_shard, device_mesh=mesh1)
        else:  # torch's keyword for the mesh
            parallelize_module(model, mesh2d, hf_tp_plan(model), tp_mesh_dim="tp")
            shard = functools.partial(fully_shard, mesh=mesh2d, mesh_dim="dp")
        for block in model.model.layers:
            shard(block)
        shard(model)
    assert all(isinstance(p, dtorch.DTensor) for p in model.parameters())
    model.to_empty(device="cpu")
    state = ref.state_dict()
    if load == "assign_dtensors":
        laid_out = model.state_dict()
        state = {k: dtorch.distribute_tensor(v, laid_out[k].device_mesh, laid_out[k].placements)
                 for k, v in state.items()}
    model.load_state_dict(state, assign=load != "copy")
    assert all(isinstance(p, dtorch.DTensor) for p in model.parameters())
    for name, buffer in ref.named_buffers():  # not in the state dict (rotary frequencies): made again, as with torch
        model.get_buffer(name).copy_(buffer)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            m(ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(model(ids).logits.full_tensor(), ref(ids).logits, **TOL)
    model(ids, labels=ids).loss.backward()
    assert all(p.grad.placements == p.placements for p in model.parameters())  # reduced as they landed
    if layout != "tp":
        shard = model.model.layers[0].mlp.up_proj.weight
        assert isinstance(shard, nn.Parameter) and shard.placements[0] == Shard(0)  # stored sharded after a forward


@pytest.mark.parametrize("reduce_dtype", [None, torch.float32], ids=["reduce_bf16", "reduce_fp32"])
def test_fully_shard_mixed_precision_trains_fp32_parameters_with_bf16_compute_as_torch(mesh1, mesh2d, reduce_dtype):
    """torch's `MixedPrecisionPolicy`: the parameters stay float32 (the optimizer's), are gathered and computed in
    bfloat16, and their gradients are reduced in `reduce_dtype` and kept in float32. The reference is what FSDP2
    computes on one device: a bfloat16 copy of the float32 model for forward and backward, its gradients stepped
    into the float32 parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    ref = tiny_llama().train()
    model = copy.deepcopy(ref)
    for block in model.model.layers:
        fully_shard(block, mesh1, mp_policy=policy)
    fully_shard(model, mesh1, mp_policy=MixedPrecisionPolicy(torch.bfloat16, reduce_dtype, output_dtype=torch.float32))
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(6))
    for _ in range(3):
        half = copy.deepcopy(ref).to(torch.bfloat16)
        want = half(ids).logits.float()
        F.cross_entropy(want.flatten(0, 1), ids.flatten()).backward()
        for r, h in zip(ref.parameters(), half.parameters()):
            r.grad = h.grad.float()
        ref_opt.step()
        got = model(ids).logits
        assert got.dtype == torch.float32  # output_dtype
        F.cross_entropy(got.flatten(0, 1), ids.flatten()).backward()
        assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        torch.testing.assert_close(got.full_tensor(), want, rtol=2e-2, atol=2e-2)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-2, atol=1e-2, msg=name)
    linear, x = nn.Linear(4, 4), torch.randn(2, 4)  # a third dtype for the reduction (before: NotImplementedError)
    sharded = fully_shard(copy.deepcopy(linear), mesh1, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float16))
    sharded(x).sum().backward()
    half = copy.deepcopy(linear).bfloat16()
    half(x.bfloat16()).sum().backward()
    assert sharded.weight.grad.dtype == torch.float32
    assert torch.equal(sharded.weight.grad.full_tensor(), half.weight.grad.half().float())
    with pytest.raises(TypeError, match="mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got dtype"):
        fully_shard(nn.Linear(4, 4), mesh1, mp_policy=torch.bfloat16)
    with pytest.raises(TypeError, match=r"fully_shard needs one mesh: fully_shard\(module, mesh\) or "):
        fully_shard(nn.Linear(4, 4), mesh1, mesh=mesh1)
    with pytest.raises(TypeError, match="fully_shard's mesh must be a dtorch.DeviceMesh, got str"):
        fully_shard(nn.Linear(4, 4), mesh="dp")
    tp = parallelize_module(nn.Linear(4, 4), mesh1, ColwiseParallel())  # (before: sharded on mesh1's dim 0 again)
    with pytest.raises(ValueError, match=r"fully_shard: parameter 'weight' of Linear lives on DeviceMesh\('cpu', "
                                         r"\[0, 1\]\), not on DeviceMesh\('cpu', \[0, 1, 2, 3\]\)"):
        fully_shard(tp, mesh=dtorch.DeviceMesh("cpu", [0, 1, 2, 3]))
    tp2d = parallelize_module(nn.Linear(4, 4), mesh2d, ColwiseParallel(), tp_mesh_dim="tp")
    with pytest.raises(ValueError, match="parameter 'weight' of Linear is already Shard\\(dim=0\\) on mesh dim 1 of "
                                         ".*; give fully_shard the data-parallel dim"):
        fully_shard(tp2d, mesh=mesh2d)  # (the default, the last dim: tp, where it would have lost its TP layout)


def test_fully_shard_takes_torchs_placement_function_ignored_parameters_and_default_policies(mesh1):
    """torch's fully_shard arguments a ported FSDP2 program passes (torchtitan's expert weights sharded on dim 1 by a
    `shard_placement_fn`, `ignored_params`, `offload_policy=OffloadPolicy()`, `reshard_after_forward=None`) were
    refused as unexpected keywords; training is torch's."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    from torch.distributed.tensor import Shard as TorchShard

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=mesh1, reshard_after_forward=None, offload_policy=OffloadPolicy(),
                shard_placement_fn=lambda p: TorchShard(1) if p.ndim == 2 and p.shape[1] == 16 else None,
                ignored_params={model[0].bias})
    assert model[2].weight.placements == (Shard(1),) and model[0].weight.placements == (Shard(0),)
    assert model[0].bias.placements == (Replicate(),) and model[2].bias.placements == (Shard(0),)
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(3)]
    expected = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), batches, lambda t: t)
    got = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches,
                 lambda t: dtorch.distribute_tensor(t, mesh1, [Shard(0)]))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    with pytest.raises(NotImplementedError, match="offload_policy=CPUOffloadPolicy: DTorch keeps the shards on"):
        fully_shard(nn.Linear(4, 4), mesh=mesh1, offload_policy=CPUOffloadPolicy())
    with pytest.raises(ValueError, match=r"shard_placement_fn gave Shard\(dim=2\) for a parameter of shape \[4, 4\]"):
        fully_shard(nn.Linear(4, 4), mesh=mesh1, shard_placement_fn=lambda p: Shard(2))


def test_torch_save_of_a_laid_out_model_says_to_save_its_state_dict(mesh1, tmp_path):
    """`torch.save(model)` pickles the module object with its layout's hooks: it failed with pickle's "Can't pickle
    local object '_apply_style.<locals>.post_hook'"; the state dict saves, and copies still copy."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(2, 4)
    for lay_out in (lambda m: parallelize_module(m, mesh1, {"0": ColwiseParallel(), "2": RowwiseParallel()}),
                    lambda m: fully_shard(m, mesh1)):
        model = lay_out(copy.deepcopy(ref))
        with pytest.raises(TypeError, match=r"^torch.save\(model\) pickles a module DTorch laid out, hooks and all: "
                                            r"save its state dict, torch.save\(model.state_dict\(\), path\)"):
            torch.save(model, io.BytesIO())
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        buf.seek(0)
        loaded = torch.load(buf)
        assert all(type(loaded[k]) is torch.Tensor and torch.equal(loaded[k], v) for k, v in ref.state_dict().items())
        twin = copy.deepcopy(model)
        torch.testing.assert_close(twin(dtorch.distribute_tensor(x, mesh1, [Replicate()])).to_torch(), ref(x), **TOL)


@pytest.mark.parametrize("reshard,how", [(True, "default"), (False, "argument"), (False, "method"),
                                         (False, "root"), (True, "root, argument")])
def test_fully_shard_frees_gathered_parameters_after_the_forward_and_gathers_them_again_for_backward(
        cluster, mesh1, reshard, how):
    """torch's FSDP2 default (reshard_after_forward=None): the blocks' gathered parameters are freed after the
    forward (autograd saved the gathered weights of every layer for its backward, so between a forward and its
    backward each worker held the whole model gathered, as under data parallelism: fully sharding saved no memory in
    training), the root's are kept for the backward, which needs them first (DTorch freed and gathered them again:
    one gather per parameter and step more than torch)."""
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256, bias=False), nn.LayerNorm(256)) for _ in range(4)])
    model = copy.deepcopy(ref)
    x = torch.randn(8, 256)
    before = worker_bytes(cluster)
    if not how.startswith("root"):  # blocks first, the root last
        for block in model:
            fully_shard(block, mesh1, **({"reshard_after_forward": False} if how == "argument" else {}))
    fully_shard(model, mesh1, **({"reshard_after_forward": True} if how == "root, argument" else {}))
    if how == "method":  # FSDP2's `FSDPModule.set_reshard_after_forward`
        model.set_reshard_after_forward(False)
    batch = dtorch.distribute_tensor(x, mesh1, [Shard(0)])
    sharded = {w: b - before.get(w, 0) for w, b in worker_bytes(cluster).items()}
    loss = model(batch).pow(2).mean()
    after_forward = {w: b - before.get(w, 0) for w, b in worker_bytes(cluster).items()}
    weights = 3 * 256 * 256 * 4  # the gathered weights autograd saves: each Linear's but the first (its input needs
    # no gradient), whole on each worker
    for w, b in after_forward.items():
        if reshard:  # the shards and the activations (a few KiB); no layer's gathered weight
            assert b - sharded[w] < 256 * 256 * 4, (w, b, sharded[w])
        else:
            assert b - sharded[w] >= weights, (w, b, sharded[w])
    loss.backward()
    ref(x).pow(2).mean().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.grad.placements == p.placements == (Shard(0),)
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, **TOL)


@pytest.mark.parametrize("precision,hsdp", [(None, False), ("bf16", False), (None, True)])
def test_fully_shard_moves_each_calls_parameters_in_one_collective_each_way_as_fsdp2(mesh1, mesh2d, precision, hsdp):
    """FSDP2's flat buffers: a `fully_shard` call's parameters are gathered in one all_gather when its module's
    forward starts (again in its backward, where it reshards) and their gradients reduced in one reduce_scatter
    (`_buckets`), and under HSDP one all_reduce over the replicated dim. DTorch gathered and reduced each parameter
    of each submodule alone: this model's step took 22 all_gathers and 15 reduce_scatters, now 6 and 4 (torch's
    FSDP2: 5 and 3). A parameter whose shards are uneven (the head's 3 rows over 2 devices) still moves alone, in
    the same step; the values are torch's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 8))  # noqa: E731
    ref = nn.Sequential(block(), block(), nn.Linear(8, 8), nn.Linear(8, 3, bias=False))
    model = copy.deepcopy(ref)
    policy = {} if precision is None else {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                             reduce_dtype=torch.float32)}
    mesh = mesh2d if hsdp else mesh1  # (HSDP: replicated over dim 0, sharded over dim 1)
    for b in model[:2]:
        fully_shard(b, mesh, **policy)
    fully_shard(model, mesh, **policy)
    x = torch.randn(8, 8)
    with CommDebugMode() as forward:
        loss = model(dtorch.distribute_tensor(x, mesh, [Shard(0)] * mesh.ndim)).pow(2).mean()
    with CommDebugMode() as backward:
        loss.backward()
    gather, scatter = torch.ops.c10d_functional.all_gather_into_tensor, torch.ops.c10d_functional.reduce_scatter_tensor
    # forward: each block's 6 parameters in one, the root's linear 2 in one and the head alone; backward: the
    # blocks' (resharded) gathered again, the root's kept; one reduce per call, the head's alone
    assert forward.get_comm_counts()[gather] == 4 and backward.get_comm_counts()[gather] == 2
    assert backward.get_comm_counts()[scatter] == 4
    if hsdp:  # each bucket's reduce all-reduced over dim 0 too
        assert backward.get_comm_counts()[torch.ops.c10d_functional.all_reduce] == 4
    ref(x).pow(2).mean().backward()
    tol = TOL if precision is None else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(loss.item(), ref(x).pow(2).mean().item(), **tol)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.placements == p.placements == (Replicate(),) * hsdp + (Shard(0),), name
        assert p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, **tol, msg=name)


def test_fully_shard_over_tensor_parallel_moves_colwise_weights_in_one_collective_too(mesh2d):
    """FSDP x TP: a colwise weight is Shard(0) on the tp dim as well as on dp, so its gathered layout keeps dim 0
    split over tp (`_buckets`' stacked dims). Such parameters were gathered and reduced one by one (in the
    pytorch/examples FSDP x TP Llama: 12 of its 13 FSDP gathers per step); now each kind is one bucket: the step
    takes 2 all_gathers (the colwise pair, the rowwise pair) and 2 reduce_scatters, with torch's values."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh2d["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh2d["dp"])
    assert model[0].weight.placements == (Shard(0), Shard(0)) and model[2].weight.placements == (Shard(0), Shard(1))
    x = torch.randn(4, 8)
    with CommDebugMode() as comm:
        model(dtorch.distribute_tensor(x, mesh2d, [Shard(0), Replicate()])).pow(2).mean().backward()
    counts = comm.get_comm_counts()
    assert counts[torch.ops.c10d_functional.all_gather_into_tensor] == 2
    assert counts[torch.ops.c10d_functional.reduce_scatter_tensor] == 2
    ref(x).pow(2).mean().backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.placements == p.placements, name
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, **TOL, msg=name)


def test_fully_shard_leaves_frozen_and_unused_parameters_without_gradients_as_torch(mesh1):
    """A group gathered together (`_buckets.Gather`) mixes parameters that train with frozen ones (LoRA's base
    weights) and ones the forward does not use: as with torch, a frozen parameter's gathered copy needs no gradient
    (the backward computes none for it) and neither has a `.grad` after the backward (a zero gradient is not None to
    an optimizer: AdamW would decay the unused weight)."""
    class Adapted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base, self.lora, self.unused = nn.Linear(8, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 8)

        def forward(self, x):
            return self.base(x) + self.lora(x)

    torch.manual_seed(0)
    ref = Adapted()
    ref.base.requires_grad_(False)
    model = copy.deepcopy(ref)
    fully_shard(model, mesh1)
    seen = []
    model.base.register_forward_pre_hook(lambda mod, _args: seen.append(mod.weight.requires_grad))
    x = torch.randn(4, 8)
    model(dtorch.distribute_tensor(x, mesh1, [Shard(0)])).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    assert seen == [False]
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (r.grad is None), name
        if r.grad is not None:
            torch.testing.assert_close(p.grad.full_tensor(), r.grad, **TOL)
    assert model.lora.weight.grad is not None and model.unused.weight.grad is None


def test_torchs_fsdp2_example_runs_with_dtorchs_fully_shard_as_written(mesh1):
    """pytorch/examples' FSDP2 example (distributed/FSDP2): layers sharded on the meta device, then the root;
    `isinstance(model, FSDPModule)` asserted; each layer's forward and backward prefetching set; with explicit
    prefetching, `model.unshard()` before every step, never `reshard()`; `clip_grad_norm_`. DTorch's modules failed
    the isinstance, had no prefetch setters, and kept the parameters `unshard()` gathered forever: from the second
    step on, every forward read the first step's weights (FSDP2 reshards them after the backward). Now the module
    is an `FSDP<Class>`, the hints are taken (each gather runs while earlier work computes), FSDP2's other settings
    are refused in one line, and the steps are torch's."""
    from torch.distributed.fsdp import FSDPModule

    def make():
        return nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                             nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))

    torch.manual_seed(0)
    ref = make()
    with torch.device("meta"):
        model = make()
    layers = [model[1], model[2]]
    for layer in layers:
        fully_shard(layer, mesh1)
    fully_shard(model, mesh1)
    assert all(isinstance(m, FSDPModule) for m in (model, *layers)) and isinstance(model, nn.Sequential)
    assert type(model).__name__ == "FSDPSequential" and isinstance(model[1:3], nn.Sequential)  # (torch's indexing)
    layers[0].set_modules_to_forward_prefetch([layers[1]])
    layers[1].set_modules_to_backward_prefetch([layers[0]])
    model.set_reshard_after_backward(False)  # (a memory hint too)
    with pytest.raises(TypeError, match="set_modules_to_forward_prefetch: Linear was not given to fully_shard"):
        layers[0].set_modules_to_forward_prefetch([model[0]])
    with pytest.raises(NotImplementedError, match=r"^FSDPSequential\.set_gradient_divide_factor: DTorch's fully_shard "
                                                  "has no such setting"):
        model.set_gradient_divide_factor(2.0)
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())
    twin = copy.deepcopy(model)
    assert type(twin) is type(model) and twin[1][0].weight.placements == (Shard(0),)
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        model.unshard()
        loss = model(dtorch.distribute_tensor(x, mesh1, [Shard(0)])).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        ref_loss = ref(x).sum()
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.item(), ref_loss.item(), **TOL)
        assert model[0].weight.placements == (Shard(0),)  # resharded after the backward, as FSDP2
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), r.detach(), **TOL)


@pytest.mark.parametrize("how", ["no_sync", "set_requires_gradient_sync"])
def test_a_data_parallel_model_accumulates_gradients_unreduced_in_no_sync_as_ddp(mesh1, how):
    """DDP's `with model.no_sync():` (and FSDP2's `set_requires_gradient_sync`) on a replicated model: the
    micro-batches inside leave their gradients unreduced (Partial, no collective), the first backward after reduces
    the sum once, and the step is torch's on the whole batch. It was an AttributeError, and each backward all-reduced
    every gradient as it landed."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = replicate_module(copy.deepcopy(ref), mesh1)
    xs = torch.randn(3, 6, 8).unbind()
    for x in xs:
        ref(x).pow(2).mean().backward()
    for x in xs[:-1]:
        with CommDebugMode() as comm:
            if how == "no_sync":
                with model.no_sync():
                    model(dtorch.distribute_tensor(x, mesh1, [Shard(0)])).pow(2).mean().backward()
            else:
                model.set_requires_gradient_sync(False)
                model(dtorch.distribute_tensor(x, mesh1, [Shard(0)])).pow(2).mean().backward()
        assert comm.get_comm_counts().get(torch.ops.c10d_functional.all_reduce, 0) == 0
        assert model[0].weight.grad.placements == (Partial(),)
    model.set_requires_gradient_sync(True)
    with CommDebugMode() as comm:
        model(dtorch.distribute_tensor(xs[-1], mesh1, [Shard(0)])).pow(2).mean().backward()
    assert comm.get_comm_counts()[torch.ops.c10d_functional.all_reduce] == 4  # once per parameter
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.grad.placements == (Replicate(),)
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, **TOL)


def test_fully_shard_accumulates_gradients_unreduced_until_requires_gradient_sync_as_fsdp2(mesh1):
    """FSDP2's gradient accumulation: `set_requires_gradient_sync(False)` on the micro-batches but the last. Their
    gradients stay unreduced (Partial, no collective), the last backward reduces the sum once, and the step is
    torch's on the whole batch (before: AttributeError, and each micro-batch reduced its own)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = copy.deepcopy(ref)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh1)
    fully_shard(model, mesh1)
    xs = torch.randn(3, 6, 8).unbind()
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        for i, x in enumerate(xs):
            ref(x).pow(2).mean().backward()
            model.set_requires_gradient_sync(i == len(xs) - 1)
            model(dtorch.distribute_tensor(x, mesh1, [Shard(0)])).pow(2).mean().backward()
            weight = model[0].weight
            if i < len(xs) - 1:
                assert weight.grad.placements == (Partial(),), (step, i)  # left unreduced on each device
            else:
                assert weight.grad.placements == weight.placements == (Shard(0),)
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), r.grad, **TOL)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), r.detach(), **TOL)
    model[0].set_requires_gradient_sync(False, recurse=False)  # one submodule alone
    model(dtorch.distribute_tensor(xs[0], mesh1, [Shard(0)])).sum().backward()
    assert model[0].weight.grad.placements == (Partial(),) and model[2].weight.grad.placements == (Shard(0),)


def test_fully_shard_unshard_keeps_the_gathered_parameters_across_forwards_until_reshard_as_fsdp2(mesh1):
    """FSDP2's `unshard()` / `reshard()` (not recursive): generation reads the parameters once per token, and each
    forward gathered and freed them again. Unsharded, the module's parameters are the gathered tensors until
    `reshard()`, forward after forward; a block sharded by its own call keeps its own gathers."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 4))
    model = copy.deepcopy(ref)
    fully_shard(model[1], mesh1)
    fully_shard(model, mesh1)
    assert model.unshard(async_op=True).wait() is None
    held = model[0].weight
    assert held.placements == (Replicate(),) and model[2].weight.placements == (Replicate(),)
    assert model[1][0].weight.placements == (Shard(0),)  # another call's group: not unsharded
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(dtorch.distribute_tensor(x, mesh1, [Shard(0)])).full_tensor(), ref(x),
                                       **TOL)
            assert model[0].weight is held  # not gathered again
    model(dtorch.distribute_tensor(x, mesh1, [Shard(0)])).sum().backward()  # training through the held gather
    ref(x).sum().backward()
    model.reshard()
    assert model[0].weight.placements == (Shard(0),) and isinstance(model[0].weight, nn.Parameter)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.placements == p.grad.placements == (Shard(0),)
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, **TOL)


class _Checkpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def test_fully_sharded_blocks_under_activation_checkpointing_save_only_their_inputs_and_train_as_torch(
        cluster, mesh1):
    """Checkpointing's own saved-tensor hooks stay in force inside a fully sharded block: fully_shard installs its
    own only where none are (`_reshard` rule 4); in their place, the block's activations were saved after all. The
    recomputation in backward gathers the parameters again."""
    torch.manual_seed(0)
    ref = nn.Sequential(*[_Checkpointed(nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)))
                          for _ in range(4)])
    model = copy.deepcopy(ref)
    for block in model:
        fully_shard(block.block, mesh1)
    x = torch.randn(256, 256)
    batch = dtorch.distribute_tensor(x, mesh1, [Shard(0)])
    before = worker_bytes(cluster)
    loss = model(batch).pow(2).mean()
    after = worker_bytes(cluster)
    activation = 128 * 256 * 4  # one activation's rows on each worker
    for w, b in after.items():  # the blocks' inputs and outputs: 5 activations; the blocks' insides were 3 each more
        assert b - before.get(w, 0) < 6 * activation, (w, b - before.get(w, 0))
    loss.backward()
    ref(x).pow(2).mean().backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, **TOL, msg=name)


def test_rl_handoff_to_a_differently_sharded_inference_mesh(reference, mesh2d, mesh1):
    model, ids, _ = reference
    policy = parallelize_module(clone(model), mesh2d, LLAMA_TP_PLAN, tp_mesh_dim="tp")
    with torch.no_grad():  # "training" changed the policy's weights
        for p in policy.parameters():
            p.mul_(1.01)
    inference = parallelize_module(tiny_llama(seed=7), mesh1, LLAMA_TP_PLAN)
    copy_weights(policy, inference)
    w = inference.model.layers[0].self_attn.q_proj.weight
    assert w.device_mesh == mesh1 and w.placements == (Shard(0),)
    expected_model = clone(model)
    with torch.no_grad():
        for p in expected_model.parameters():
            p.mul_(1.01)
        expected = expected_model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    got = inference.generate(dtorch.distribute_tensor(ids[:1], mesh1, [Replicate()]), max_new_tokens=4,
                             do_sample=False)
    assert got.to_torch().tolist() == expected.tolist()


def test_deepcopy_of_a_parallelized_model_is_an_independent_copy_on_the_cluster(reference, mesh1):
    model, ids, logits = reference
    tp = parallelize_module(clone(model), mesh1, LLAMA_TP_PLAN)
    twin = copy.deepcopy(tp)  # torch's default copied the tensor ids and tried to copy the connection
    w, w2 = tp.model.layers[0].self_attn.q_proj.weight, twin.model.layers[0].self_attn.q_proj.weight
    assert isinstance(w2, nn.Parameter) and w2.requires_grad and w2.placements == w.placements == (Shard(0),)
    assert w2._tid != w._tid
    with torch.no_grad():
        for p in tp.parameters():
            p.zero_()  # the copy does not see it
        got = twin(dtorch.distribute_tensor(ids, mesh1, [Replicate()])).logits
    torch.testing.assert_close(got.to_torch(), logits, **TOL)
    assert not tp.model.layers[0].self_attn.q_proj.weight.to_torch().any()


def test_torch_save_of_a_parallelized_state_dict_is_a_plain_checkpoint_that_loads_sharded_again(reference, mesh1,
                                                                                               mesh2d):
    model, ids, logits = reference
    tp = parallelize_module(clone(model), mesh1, LLAMA_TP_PLAN)
    with torch.no_grad():
        for p in tp.parameters():
            p.mul_(1.01)  # "trained": only the cluster has these values
    buffer = io.BytesIO()
    torch.save(tp.state_dict(), buffer)  # failed: a DTensor could not be pickled
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # plain tensors: readable with no cluster
    expected = {k: v * 1.01 if k in dict(model.named_parameters()) else v for k, v in model.state_dict().items()}
    assert all(type(v) is torch.Tensor for v in saved.values()) and saved.keys() == expected.keys()
    for k, v in saved.items():
        torch.testing.assert_close(v, expected[k])
    other = parallelize_module(tiny_llama(seed=5), mesh2d, LLAMA_TP_PLAN, tp_mesh_dim="tp")
    other.load_state_dict(saved)  # sharded again, here on another mesh
    w = other.model.layers[0].self_attn.q_proj.weight
    assert w.device_mesh == mesh2d and w.placements == (Replicate(), Shard(0))
    reloaded = tiny_llama(seed=9)
    reloaded.load_state_dict(saved)
    with torch.no_grad():
        want = reloaded(ids).logits
        got = other(dtorch.distribute_tensor(ids, mesh2d, [Replicate(), Replicate()])).logits
    torch.testing.assert_close(got.to_torch(), want, **TOL)


def test_llama_twenty_training_steps_dp_x_tp_match_torch(mesh2d):
    ref = tiny_llama()
    ref.train()
    model = clone(ref).train()
    parallelize_module(model, mesh2d, LLAMA_TP_PLAN, tp_mesh_dim="tp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(3)
    expected, got = [], []
    for _ in range(20):
        ids = torch.randint(0, 96, (4, 8), generator=gen)
        loss = ref(ids, labels=ids).loss
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        expected.append(loss.item())
        dids = dtorch.distribute_tensor(ids, mesh2d, [Shard(0), Replicate()])
        dloss = model(dids, labels=dids).loss
        opt.zero_grad()
        dloss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        got.append(dloss.item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert got[-1] != got[0]  # it did train


@pytest.mark.parametrize("causal", [False, True])
def test_context_parallel_attention_forward_and_backward(mesh4, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 12, 8, requires_grad=True) for _ in range(3))
    dq, dk, dv = (dtorch.distribute_tensor(t.detach(), mesh4, [Shard(2)]).requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(dq, dk, dv, is_causal=causal)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert out.placements == (Shard(2),)  # the sequence stays sharded: keys and values were gathered
    torch.testing.assert_close(out.to_torch(), expected, **TOL)
    grad = torch.randn_like(expected)
    out.backward(dtorch.distribute_tensor(grad, mesh4, [Shard(2)]))
    expected.backward(grad)
    for d, t in ((dq, q), (dk, k), (dv, v)):
        torch.testing.assert_close(d.grad.to_torch(), t.grad, **TOL)


def test_llama_context_parallel(reference, mesh1, monkeypatch):
    from dtorch import _dispatch

    model, ids, logits = reference
    cp = replicate_module(clone(model), mesh1)
    made = []  # every plan this forward makes, kept in the cache or not
    plan = _dispatch.planner.plan
    monkeypatch.setattr(_dispatch.planner, "plan", lambda *a: made.append(plan(*a)) or made[-1])
    _dispatch.planner.clear()  # so that no op of the forward is served by an earlier test's plan
    with torch.no_grad():
        out = cp(dtorch.distribute_tensor(ids, mesh1, [Shard(1)])).logits  # the sequence dim is sharded
    torch.testing.assert_close(out.to_torch(), logits, **TOL)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    plans = [p for p in made if p.func is flash and p.outputs[0].placements == (Shard(2),)]
    assert plans, "attention did not run sequence-sharded"


@pytest.mark.parametrize("mesh_name", ["mesh4", "mesh2d"])
def test_sequence_sharded_linear_keeps_strided_shards(request, mesh_name):
    """A linear over sequence-sharded samples: `[B, S, H] -> [B*S, H]` is a strided shard (torch's `_StridedShard`,
    split factor B), the matmul keeps it and the view back is Shard(1); a strided tensor reads, moves, feeds an op
    that must move it, and differentiates, all equal to torch."""
    from dtorch._spec import StridedShard

    mesh = request.getfixturevalue(mesh_name)
    seq = [Shard(1)] if mesh.ndim == 1 else [Replicate(), Shard(1)]
    torch.manual_seed(0)
    x = torch.randn(3, 9, 8, requires_grad=True)  # 9 positions over 2 or 4 devices: uneven shards
    w = torch.randn(8, 5, requires_grad=True)
    dx = dtorch.distribute_tensor(x.detach(), mesh, seq).requires_grad_()
    dw = dtorch.distribute_tensor(w.detach(), mesh, [Replicate()] * mesh.ndim).requires_grad_()
    flat = dx.view(27, 8)
    strided = (*seq[:-1], StridedShard(0, 3))
    assert flat.placements == strided
    torch.testing.assert_close(flat.to_torch(), x.detach().view(27, 8))
    y = (flat @ dw).view(3, 9, 5)
    assert y.placements == tuple(seq)  # the sequence stayed sharded through the linear
    torch.testing.assert_close(y.to_torch(), x.detach() @ w.detach())
    for target in ([Replicate()], [Shard(0)], [Shard(1)]):
        target = [*seq[:-1], *target]
        moved = flat.redistribute(placements=target)
        assert moved.placements == tuple(target)
        torch.testing.assert_close(moved.to_torch(), x.detach().view(27, 8))
    other = dtorch.distribute_tensor(torch.ones(27, 8), mesh, [*seq[:-1], Shard(0)])
    torch.testing.assert_close((flat + other).to_torch(), x.detach().view(27, 8) + 1)  # the op moves it first
    gathered = flat.redistribute(placements=[*seq[:-1], Replicate()])  # its gradient moves back to strided shards
    ((y * y).sum() + (gathered * 3).sum()).backward()
    (((x @ w) ** 2).sum() + (x.view(27, 8) * 3).sum()).backward()
    torch.testing.assert_close(dx.grad.to_torch(), x.grad, **TOL)
    torch.testing.assert_close(dw.grad.to_torch(), w.grad, **TOL)


def test_optimizers_and_clipping_take_their_foreach_paths_as_with_torch_dtensor(mesh1):
    """DTorch's DTensor is registered where torch registers its own: `clip_grad_norm_` groups DTensors into
    `_foreach_` ops (on CPU, as it does plain tensors) and AdamW(foreach=True) trains as plain torch does."""
    from torch.utils._foreach_utils import _has_foreach_support

    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(8, 4, generator=gen), torch.randn(4, generator=gen)]
    params = [nn.Parameter(dtorch.distribute_tensor(w, mesh1, [Shard(0)])) for w in ws]
    refs = [nn.Parameter(w.clone()) for w in ws]
    assert _has_foreach_support(params, params[0].device)
    opt, ref_opt = torch.optim.AdamW(params, lr=0.1, foreach=True), torch.optim.AdamW(refs, lr=0.1, foreach=True)
    for _ in range(3):
        norms = []
        for ps, o in ((params, opt), (refs, ref_opt)):
            o.zero_grad()
            sum((p * p).sum() for p in ps).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(ps, 0.5))
            o.step()
        torch.testing.assert_close(norms[0].to_torch(), norms[1], **TOL)
    for p, r in zip(params, refs):
        torch.testing.assert_close(p.to_torch(), r.detach(), **TOL)


FUSED = {  # name -> optimizer(params), fused=True
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
    "sgd momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, fused=True),
    "sgd nesterov maximize": lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.05), momentum=0.9, nesterov=True,
                                                        maximize=True, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, weight_decay=0.01, fused=True),
    "adagrad maximize": lambda ps: torch.optim.Adagrad(ps, lr=0.1, maximize=True, fused=True),
}


@pytest.mark.parametrize("scaled", [False, True], ids=["", "grad_scaler"])
@pytest.mark.parametrize("name", list(FUSED))
def test_fused_sgd_and_adagrad_train_as_torch(mesh1, name, scaled):
    """`SGD(fused=True)` and `Adagrad(fused=True)` failed on DTensors ("output shapes that depend on the values",
    "would write into the plain torch.Tensor 'state_steps'"), as on torch's DTensor; they run as the foreach ops
    of their kernels' math now (`_optimizers`), with a GradScaler's skipped steps too."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model = parallelize_module(copy.deepcopy(ref), mesh1, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opts = FUSED[name](model.parameters()), FUSED[name](ref.parameters())
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled) for _ in range(2)]
    x = torch.randn(6, 8)
    for step in range(4):
        for net, opt, scaler in zip((model, ref), opts, scalers):
            loss = net(x * (float("inf") if scaled and step == 2 else 1.0)).pow(2).mean()  # step 2: skipped
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), r.detach(), **TOL)
    assert scalers[0].get_scale() == scalers[1].get_scale()


def test_grad_scaler_unscales_sharded_gradients_and_skips_the_step_of_an_overflow(mesh1):
    """`torch.amp.GradScaler` on DTensor gradients (sharded and replicated): each step unscales them, a step whose
    gradient overflows on one shard is skipped and halves the scale, the others grow it, as with plain torch."""
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(8, 4, generator=gen), torch.randn(4, generator=gen)]
    params = [nn.Parameter(dtorch.distribute_tensor(w, mesh1, [p])) for w, p in zip(ws, (Shard(0), Replicate()))]
    refs = [nn.Parameter(w.clone()) for w in ws]
    runs = []
    for ps in (params, refs):
        opt, scaler = torch.optim.SGD(ps, lr=0.1), torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1)
        scales = []
        for step in range(4):
            opt.zero_grad()
            loss = (ps[0] * ps[0]).sum() + ps[1].sum()
            if step == 1:  # overflows on the rows of the first shard only
                loss = loss + (ps[0][:2] * 1e38).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append(scales)
    assert runs[0] == runs[1] == [512.0, 256.0, 512.0, 1024.0]
    for p, r in zip(params, refs):
        torch.testing.assert_close(p.to_torch(), r.detach(), **TOL)


def test_gradient_norms_of_every_order_in_turn_are_torchs(mesh1):
    """`_foreach_norm`'s plan depends on its order (max of shards for inf, a sum of powers otherwise): the plan
    cache kept it for any order as it does elementwise ops' plans, so after an inf norm every other order was
    wrong (clip_grad_norm_(norm_type=1) after a norm_type=inf one)."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(16, 8, generator=gen), torch.randn(16, generator=gen), torch.randn(4, 16, generator=gen),
             torch.randn(4, generator=gen)]
    placements = (Shard(0), Shard(0), Shard(1), Replicate())
    dgrads = [dtorch.distribute_tensor(g, mesh1, [p]) for g, p in zip(grads, placements)]
    for order in (float("inf"), 1.0, 2.0, 3.0, 1.0, float("inf"), 2.0):
        torch.testing.assert_close(torch.nn.utils.get_total_norm(dgrads, order).to_torch(),
                                   torch.nn.utils.get_total_norm(grads, order), **TOL)


def test_a_gradient_torch_makes_as_plain_zeros_becomes_the_parameters_layout(mesh1):
    """torch's formula for `sgn` makes its zero gradient with a factory that takes no tensor, so autograd stored a
    plain tensor as a DTensor parameter's `.grad`; it is now a DTensor laid out as the parameter, and AdamW steps as
    with torch."""
    class Signed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.v = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            return x * torch.sgn(self.w) + x * self.v

    torch.manual_seed(0)
    ref = Signed()
    model = copy.deepcopy(ref)
    replicate_module(model, mesh1)
    x = torch.randn(4, 3)
    for m, inp in ((model, dtorch.distribute_tensor(x, mesh1, [Replicate()])), (ref, x)):
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        (m(inp) ** 2).sum().backward()
        opt.step()
    assert isinstance(model.w.grad, dtorch.DTensor) and model.w.grad.placements == model.w.placements
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.to_torch(), r.detach(), **TOL)


def test_fsdp2_examples_checkpoint_through_the_state_dict_api_resumes_training_as_torch(mesh1, tmp_path):
    """pytorch/examples' FSDP2 checkpointing with `--dcp-api`: `get_model_state_dict` and `get_optimizer_state_dict`
    with `full_state_dict=True, cpu_offload=True`, `torch.save`, then into a model built on the meta device,
    `set_model_state_dict` and `set_optimizer_state_dict` with `full_state_dict=True, broadcast_from_rank0=True`. With
    torch's functions the full dicts held DTorch's handles, and the load failed asking for the default process group;
    DTorch's (`dtorch.checkpoint`, the same names) give plain full tensors and load into the layouts, so training
    resumes as torch's does."""
    from dtorch.checkpoint import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    def make():
        return nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))

    def sharded():
        with torch.device("meta"):
            model = make()
        for layer in (model[0], model[1], model[2]):
            fully_shard(layer, mesh1)
        fully_shard(model, mesh1)
        return model

    def step(model, opt, x, to_mesh):
        loss = model(to_mesh(x)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    torch.manual_seed(0)
    ref = make()
    model = sharded()
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 8, generator=gen) for _ in range(3)]
    on_mesh = functools.partial(dtorch.distribute_tensor, device_mesh=mesh1, placements=[Shard(0)])
    for x in batches[:2]:
        assert step(model, opt, x, on_mesh) == pytest.approx(step(ref, ref_opt, x, lambda t: t), rel=1e-5)

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_model_state_dict(model, options=full), get_optimizer_state_dict(model, opt, options=full)
    ref_model_sd = ref.state_dict()
    assert model_sd.keys() == ref_model_sd.keys()
    for k, v in model_sd.items():
        assert type(v) is torch.Tensor and not v.requires_grad, k
        torch.testing.assert_close(v, ref_model_sd[k], **TOL)
    moments = [v for state in optim_sd["state"].values() for v in state.values() if v.dim() > 0]
    assert len(moments) == 2 * len(ref_model_sd) and all(type(v) is torch.Tensor for v in moments)
    sharded_sd = get_model_state_dict(model)  # without the option: the parameters as they are laid out
    assert isinstance(sharded_sd["0.weight"], dtorch.DTensor) and sharded_sd["0.weight"].placements == (Shard(0),)
    torch.save(model_sd, tmp_path / "model.pt")
    torch.save(optim_sd, tmp_path / "optim.pt")

    resumed = sharded()
    resumed.to_empty(device="cpu")
    loading = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(resumed, torch.load(tmp_path / "model.pt", mmap=True, weights_only=True), options=loading)
    assert resumed[0].weight.placements == (Shard(0),)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    set_optimizer_state_dict(resumed, resumed_opt, torch.load(tmp_path / "optim.pt", weights_only=True),
                             options=loading)
    assert step(resumed, resumed_opt, batches[2], on_mesh) == pytest.approx(
        step(ref, ref_opt, batches[2], lambda t: t), rel=1e-5)
    for p, r in zip(resumed.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), r.detach(), **TOL)


def test_sequence_parallel_example_takes_its_plain_input_sharded_and_communicates_as_torchs(mesh1):
    """pytorch/examples' sequence_parallel_example: `ColwiseParallel(input_layouts=Shard(0))` and
    `RowwiseParallel(output_layouts=Shard(0))` on a plain input. The input is the whole batch (the program runs once),
    laid out as the style says it comes: each device is sent its rows, gathered for the first linear, and the
    output reduce-scattered back to rows. That is torch's forward, one all_gather and one reduce_scatter; the input
    was replicated before (sent whole to every device, no gather), so the table read differently from torch's."""

    class ToyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.in_proj, self.relu, self.out_proj = nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5)

        def forward(self, x):
            return self.out_proj(self.relu(self.in_proj(x)))

    torch.manual_seed(0)
    ref = ToyModel()
    model = parallelize_module(copy.deepcopy(ref), mesh1, {"in_proj": ColwiseParallel(input_layouts=Shard(0)),
                                                           "out_proj": RowwiseParallel(output_layouts=Shard(0))})
    inp = torch.rand(20, 10)
    with CommDebugMode() as comm:
        out = model(inp)
    assert {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()} == {
        "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), ref(inp), **TOL)
    out.sum().backward()
    ref(inp).sum().backward()
    torch.testing.assert_close(model.in_proj.weight.grad.full_tensor(), ref.in_proj.weight.grad, **TOL)
