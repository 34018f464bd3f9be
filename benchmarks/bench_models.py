"""Model figures, measured side by side in one run (printed, never asserted).

(a) per denoising step of an SD3 transformer (diffusers, random weights, classifier-free guidance batch of 2):
    user-thread time (the step's ops issued) and end-to-end time (steps chained as in the pipeline's loop, the
    latents back on the client at the end, divided by the steps), plain torch eager against DTorch on the
    embedded cluster: the transformer tensor parallel (TP=2) and guidance-parallel x sequence parallel (2x2);
(b) the same for one mixture-of-experts layer's forward (transformers' MixtralSparseMoeBlock) under expert
    parallelism (EP=2, tokens sharded with the experts) against plain torch;
(c) a tensor-parallel LM head and its cross entropy, forward and backward (TP=2): the head's logits gathered
    (`ColwiseParallel(output_layouts=Replicate())`) against left sharded over the vocabulary (`ColwiseParallel()`,
    the loss reduced per row: dtorch._softmax, _losses rule 4), with the bytes each worker received per step (its
    own counters), against plain torch.

    python benchmarks/bench_models.py [--steps 5] [--tokens 1024] [--layers 4] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.nn import ColwiseParallel, ExpertParallel, parallelize_module
from dtorch.nn.plans import sd3_cfg_plan, sd3_sp_plan, sd3_tp_plan


def sd3(layers: int):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)  # at least 2 blocks: the last one has no text MLP, which the TP plan names
    return SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=16, num_layers=max(layers, 2),
                                 attention_head_dim=64, num_attention_heads=8, caption_projection_dim=512,
                                 joint_attention_dim=512, pooled_projection_dim=256, out_channels=16,
                                 pos_embed_max_size=64).eval()


def step_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(2, 16, 32, 32, generator=g),
            "encoder_hidden_states": torch.randn(2, 64, 512, generator=g),
            "pooled_projections": torch.randn(2, 256, generator=g), "timestep": torch.tensor([500.0, 500.0])}


def denoise(model, inputs: dict, steps: int, fetch) -> tuple[float, float]:
    """(user-thread s, end-to-end s) per step of `steps` chained steps (latents -= 0.1 * noise prediction)."""
    with torch.no_grad():
        latents = inputs["hidden_states"]
        start = time.perf_counter()
        for _ in range(steps):
            out = model(**{**inputs, "hidden_states": latents}).sample
            latents = latents - 0.1 * out
        issued = time.perf_counter() - start
        fetch(latents)
        total = time.perf_counter() - start
    return issued / steps, total / steps


def plain_rows(run, repeats: int) -> list[tuple[str, float, float]]:
    """Plain torch with all of this process's threads, and with one (what each CPU worker uses)."""
    threads, rows = torch.get_num_threads(), []
    for n in (threads, 1):
        torch.set_num_threads(n)
        run()  # warm
        rows.append((f"plain torch eager, {n} thread{'s' if n > 1 else ''}", *best([run() for _ in range(repeats)])))
    torch.set_num_threads(threads)
    return rows


def best(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return min(r[0] for r in runs), statistics.median(r[1] for r in runs)


def bench_sd3(steps: int, layers: int, repeats: int) -> list[tuple[str, float, float]]:
    ref = sd3(layers)
    inputs = step_inputs(torch.Generator().manual_seed(1))
    rows = plain_rows(lambda: denoise(ref, inputs, steps, lambda t: t), repeats)
    tp = dtorch.DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",))
    cfg_sp = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("cfg", "sp"))
    for name, mesh, plans in (("DTorch TP=2", tp, [(sd3_tp_plan(), "tp")]),
                              ("DTorch CFG=2 x SP=2 (4 devices on 2 workers)", cfg_sp,
                               [(sd3_cfg_plan(), "cfg"), (sd3_sp_plan(), "sp")])):
        model = copy.deepcopy(ref)
        for plan, dim in plans:
            parallelize_module(model, mesh, plan, tp_mesh_dim=dim)
        d = {k: dtorch.distribute_tensor(v, mesh, [Replicate()] * mesh.ndim) for k, v in inputs.items()}
        denoise(model, d, 1, lambda t: t.to_torch())  # warm: meshes placed, plans made
        rows.append((name, *best([denoise(model, d, steps, lambda t: t.to_torch()) for _ in range(repeats)])))
    return rows


def bench_moe(tokens: int, repeats: int, iters: int) -> list[tuple[str, float, float]]:
    import transformers

    cfg = transformers.MixtralConfig(hidden_size=512, intermediate_size=1024, num_local_experts=8,
                                     num_experts_per_tok=2)
    torch.manual_seed(0)
    ref = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg).eval()
    torch.nn.init.normal_(ref.gate.weight, std=0.02)
    for p in ref.experts.parameters():
        torch.nn.init.normal_(p, std=0.02)

    cfg._experts_implementation = "grouped_mm"
    x = torch.randn(1, tokens, 512, generator=torch.Generator().manual_seed(2))
    rows = plain_rows(lambda: denoise_moe(ref, x, iters, lambda t: t), repeats)
    mesh = dtorch.DeviceMesh("cpu", [0, 1], mesh_dim_names=("ep",))
    block = parallelize_module(copy.deepcopy(ref), mesh, {"experts": ExpertParallel()}, tp_mesh_dim="ep")
    dx = dtorch.distribute_tensor(x, mesh, [Shard(1)])
    denoise_moe(block, dx, 1, lambda t: t.to_torch())
    rows.append(("DTorch EP=2", *best([denoise_moe(block, dx, iters, lambda t: t.to_torch())
                                      for _ in range(repeats)])))
    return rows


def denoise_moe(block, x, iters: int, fetch) -> tuple[float, float]:
    """(user-thread s, end-to-end s) per forward of `iters` chained layer forwards (x += layer(x))."""
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(iters):
            x = x + block(x)
        issued = time.perf_counter() - start
        fetch(x)
        total = time.perf_counter() - start
    return issued / iters, total / iters


def bench_vocab_loss(tokens: int, vocab: int, repeats: int) -> list[tuple[str, float, float, float]]:
    """(name, user-thread s, end-to-end s, MiB each worker received) per head + cross entropy step."""
    hidden = 256
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(tokens, hidden, generator=g), torch.randint(0, vocab, (tokens,), generator=g)

    def step(model, inputs, targets, fetch) -> tuple[float, float]:
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        issued = time.perf_counter() - start
        fetch(loss)
        return issued, time.perf_counter() - start

    xr = x.clone().requires_grad_()
    rows = [("plain torch", *best([step(head, xr, y, lambda t: t.item()) for _ in range(repeats)]), 0.0)]
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    dx = dtorch.distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
    dy = dtorch.distribute_tensor(y, mesh, [Replicate()])

    def received() -> list[int]:
        return [w.received_bytes for w in dtorch.status().workers]

    for name, style in (("DTorch TP=2, logits gathered", ColwiseParallel(output_layouts=Replicate())),
                        ("DTorch TP=2, vocabulary-parallel", ColwiseParallel())):
        model = parallelize_module(copy.deepcopy(head), mesh, style)
        step(model, dx, dy, lambda t: t.item())
        before = received()
        runs = [step(model, dx, dy, lambda t: t.item()) for _ in range(repeats)]
        moved = max(b - a for a, b in zip(before, received())) / repeats / 2**20
        rows.append((name, *best(runs), moved))
    return rows


def show(title: str, rows: list[tuple[str, float, float]]) -> None:
    print(title)
    base = rows[0][2]  # plain torch with all threads
    for name, issued, total in rows:
        print(f"  {name:48s} user thread {issued * 1e3:8.1f} ms   end to end {total * 1e3:8.1f} ms "
              f"({total / base:5.2f}x plain torch)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    os.environ.setdefault("DTORCH_HEARTBEAT_TIMEOUT", "10")  # a busy 2-core machine can starve a heartbeat
    dtorch.connect(workers=int(os.environ.get("DTORCH_LOCAL_WORKERS", "2")))
    threads = torch.get_num_threads()
    print(f"bench_models: torch {torch.__version__}, {os.cpu_count()} CPUs, {threads} torch threads in this process, "
          "CPU workers 1 thread each")
    show(f"(a) SD3 transformer, one denoising step ({args.layers} blocks, 256 image + 64 text tokens, CFG batch 2)",
         bench_sd3(args.steps, args.layers, args.repeats))
    show(f"(b) one Mixtral MoE layer forward (8 experts, top-2, {args.tokens} tokens, hidden 512)",
         bench_moe(args.tokens, args.repeats, args.steps))
    print(f"(c) an LM head ({args.vocab} classes, hidden 256) and its cross entropy over {args.tokens} tokens, "
          "forward and backward")
    vocab_rows = bench_vocab_loss(args.tokens, args.vocab, args.repeats)
    for name, issued, total, moved in vocab_rows:
        print(f"  {name:48s} user thread {issued * 1e3:8.1f} ms   end to end {total * 1e3:8.1f} ms "
              f"({total / vocab_rows[0][2]:5.2f}x plain torch)   {moved:8.2f} MiB received per worker")
    dtorch.shutdown()


if __name__ == "__main__":
    main()
