"""One CUDA device: DTorch's CUDA worker against plain torch on the same GPU, side by side in one run (printed, never
asserted). The multi-GPU comparison with torch DTensor over NCCL is `bench_vs_torch.py --device cuda` (2+ GPUs).

    python benchmarks/bench_gpu.py [--repeats 10] [--hidden 4096] [--batch 4096] [--mib 64 1024] [--device cuda|cpu]

(`--device cpu` runs the same items on the CPU: a check of this script on a machine without a GPU.)

DTorch runs on an embedded local cluster of one CUDA worker (DTORCH_LOCAL_DEVICE=cuda:0); plain torch runs in this
process on the same GPU, after DTorch has shut down (never at the same time). Items:

(put/pull) a 64 MiB and a 1 GiB float32 tensor from the client's host memory onto the GPU (`distribute_tensor`,
    waited for) and back (`to_torch()`), in GB/s, against torch's `.to("cuda")` from pageable and from pinned memory
    and `.cpu()`: DTorch moves the bytes through a same-host shared-memory segment (dtorch_protocol.segments),
    and, as "streamed", over gRPC as a client on another host does (DTORCH_SHARED_MEMORY=0);
(op) user-thread time per op of a shape-(1,) add in a loop (DTorch streams ops; CUDA launches asynchronously), and
    the whole loop with its value back;
(mlp) a 4-layer MLP (--hidden wide, --batch rows, float32) as Megatron TP=2 on a mesh of 2 logical devices that
    both live on the one GPU, forward (value back on the client) and a training step (SGD, loss back), against
    plain torch: where the GPU's compute dominates, the gap is DTorch's control and client copies.

Figures are medians of --repeats runs; ratios are DTorch / torch (below 1.0x: DTorch is faster).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn as nn
from bench_vs_torch import median_ms, sgd_step  # the same timing and training step as the multi-GPU comparison

TP_PLAN_KEYS = ("0", "2", "4", "6")


def make_mlp(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(4):
        layers += [nn.Linear(hidden, hidden), nn.ReLU() if i < 3 else nn.Identity()]
    return nn.Sequential(*layers)


def sizes(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [(f"{mib} MiB" if mib < 1024 else f"{mib // 1024} GiB", mib << 20) for mib in args.mib]


def repeats_for(nbytes: int, repeats: int) -> int:
    return max(3, repeats // (4 if nbytes > (256 << 20) else 1))


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms / 1e3) / 1e9


def run_dtorch(args: argparse.Namespace) -> dict:
    import dtorch
    from dtorch import Replicate
    from dtorch.nn import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ["DTORCH_LOCAL_DEVICE"] = "cuda:0" if args.device == "cuda" else "cpu"
    out: dict[str, float] = {}
    os.environ["DTORCH_SHARED_MEMORY"] = "0"  # first the bytes as gRPC streams (what a client on another host gets)
    dtorch.connect(workers=1)
    out.update({f"{key} streamed": v for key, v in transfers(args).items()})
    dtorch.shutdown()
    os.environ["DTORCH_SHARED_MEMORY"] = "1"
    dtorch.connect(workers=1)
    out.update(transfers(args))
    one = dtorch.DeviceMesh(args.device, [0])
    x = dtorch.zeros(1, device_mesh=one, placements=[Replicate()])
    inc = dtorch.ones(1, device_mesh=one, placements=[Replicate()])
    (x + inc).to_torch()
    t0 = time.perf_counter()
    y = x
    for _ in range(args.iters):
        y = y + inc
    out["op issue"] = (time.perf_counter() - t0) / args.iters * 1e6
    if y.to_torch().item() != args.iters:
        raise AssertionError(f"op: dtorch computed {y.to_torch().item()}, expected {args.iters}")
    out["op loop"] = (time.perf_counter() - t0) / args.iters * 1e6

    mesh = dtorch.DeviceMesh(args.device, [0, 1])  # two logical devices, one GPU
    model = make_mlp(args.hidden)
    parallelize_module(model, mesh, {k: ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                                     for i, k in enumerate(TP_PLAN_KEYS)})
    g = torch.Generator().manual_seed(1)
    inp_t, target_t = (torch.randn(args.batch, args.hidden, generator=g) for _ in range(2))
    inp, target = (dtorch.distribute_tensor(t, mesh, [Replicate()]) for t in (inp_t, target_t))
    with torch.no_grad():
        out["mlp forward"] = median_ms(lambda: model(inp).to_torch(), args.repeats)
        value = model(inp).to_torch()
    out["mlp step"] = median_ms(sgd_step(model, inp, target), args.repeats)
    dtorch.shutdown()
    ref = make_mlp(args.hidden).to(args.device)
    with torch.no_grad():
        out["mlp forward error"] = (ref(inp_t.to(args.device)).cpu() - value).abs().max().item()
    return out


def transfers(args: argparse.Namespace) -> dict[str, float]:
    """(put/pull) GB/s of DTorch's client transfers in the connected session."""
    import dtorch
    from dtorch import Replicate

    out = {}
    session = dtorch.runtime.get_session()
    one = dtorch.DeviceMesh(args.device, [0])
    for name, n in sizes(args):
        host = torch.ones(n // 4)
        reps = repeats_for(n, args.repeats)
        out[f"put {name}"] = gbps(n, median_ms(
            lambda host=host: (dtorch.distribute_tensor(host, one, [Replicate()]), session.sync()), reps, warmup=1))
        on_gpu = dtorch.distribute_tensor(host, one, [Replicate()])
        out[f"pull {name}"] = gbps(n, median_ms(on_gpu.to_torch, reps, warmup=1))
        if not torch.equal(on_gpu.to_torch(), host):
            raise AssertionError(f"pull {name}: the bytes back differ from those put")
        del on_gpu
    return out


def run_torch(args: argparse.Namespace) -> dict:
    out: dict[str, float] = {}
    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    for name, n in sizes(args):
        host = torch.ones(n // 4)
        pinned = host.pin_memory() if dev == "cuda" else host.clone()
        reps = repeats_for(n, args.repeats)
        out[f"put {name}"] = gbps(n, median_ms(lambda host=host: (host.to(dev), sync()), reps, warmup=1))
        out[f"put {name} pinned"] = gbps(n, median_ms(
            lambda pinned=pinned: (pinned.to(dev, non_blocking=True), sync()), reps, warmup=1))
        on_gpu = host.to(dev)
        out[f"pull {name}"] = gbps(n, median_ms(on_gpu.cpu, reps, warmup=1))
        del on_gpu, pinned
    a, b = torch.zeros(1, device=dev), torch.ones(1, device=dev)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        a = a + b
    out["op issue"] = (time.perf_counter() - t0) / args.iters * 1e6
    a.item()
    out["op loop"] = (time.perf_counter() - t0) / args.iters * 1e6
    model = make_mlp(args.hidden).to(dev)
    g = torch.Generator().manual_seed(1)
    inp, target = (torch.randn(args.batch, args.hidden, generator=g).to(dev) for _ in range(2))
    with torch.no_grad():
        out["mlp forward"] = median_ms(lambda: model(inp).cpu(), args.repeats)
    out["mlp step"] = median_ms(sgd_step(model, inp, target), args.repeats)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--mib", type=int, nargs="+", default=[64, 1024], help="put/pull sizes in MiB")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA device: torch sees none on this machine")
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"# {name}, torch {torch.__version__}, MLP {args.hidden} wide, batch {args.batch}",
          flush=True)
    ours = run_dtorch(args)
    theirs = run_torch(args)
    print(f"{'item':<24}{'DTorch':>12}{'torch':>12}{'ratio':>9}  unit")
    for key, value in ours.items():
        peer = theirs.get(key.removesuffix(" streamed"))
        unit = "GB/s" if key.startswith(("put", "pull")) else "us" if key.startswith("op") else (
            "max abs" if "error" in key else "ms")
        ratio = f"{value / peer:.2f}x" if peer else ""
        print(f"{key:<24}{value:>12.3f}{peer if peer is not None else float('nan'):>12.3f}{ratio:>9}  {unit}")
    for key in theirs.keys() - ours.keys():
        print(f"{key:<24}{'':>12}{theirs[key]:>12.3f}{'':>9}  GB/s")


if __name__ == "__main__":
    main()
