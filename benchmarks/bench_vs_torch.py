"""DTorch against PyTorch's own DTensor and plain torch, side by side in one run (printed, never asserted).

    python benchmarks/bench_vs_torch.py [--repeats 10] [--quick] [--only a,b,c,d,e,f,g,h,i] [--device cpu|cuda]
                                        [--rounds 1] [--auto-compile on|off]  (--rounds: (a)-(d) in turns)

Three contenders, one after the other on the same machine (never at the same time):

* **DTorch**: a single-controller program on an embedded local cluster of 2 worker processes (4 for (e)), with
  automatic capture on as users get it (`--auto-compile off`: every op eager);
* **torch DTensor**: 2 ranks spawned here with `torch.multiprocessing`, gloo (NCCL with `--device cuda`),
  SPMD code as torch users write it (`init_device_mesh`, `parallelize_module`, `distribute_tensor`);
* **plain torch**: one process, the same ops on whole tensors.

Items (those of issue #11):

(a) user-thread time per op of a shape-(1,) add, in a loop (DTorch streams ops: the user thread only issues);
(b) a 4-layer 1024x1024 MLP forward, batch 64, Megatron TP=2, with the value back on the client (rank 0 for
    torch);
(c) the same MLP, forward + backward + SGD step, TP=2, loss back on the client;
(d) all_reduce (Partial -> Replicate) and all_gather (Shard(0) -> Replicate) bandwidth from 4 KiB to 256 MiB on
    2 devices, against raw `torch.distributed` collectives on 2 gloo ranks;
(e) bytes received per device for a `Partial -> Replicate` of a 4 MiB tensor on 2 and 4 devices, from the
    workers' own counters (`WorkerStatus.received_bytes`), and the bytes the client pulls to read the Partial
    tensor (`to_torch()`: combined on the workers first, one copy; one per device until session 23);
(f) overlap: a data-parallel training step (DP=2, the MLP above, batch 256 sharded) with collectives in flight
    while the workers compute (the default) against the same step with each collective waited for where it is
    issued (workers started with DTORCH_SYNC_COLLECTIVES=1): each gradient's all-reduce is issued as soon as
    autograd accumulated it, so with overlap it runs during the rest of the backward pass. Besides the step
    times, from `dtorch.profile()` records of a few steps (each collective's record says when it landed): how
    long per step and worker collectives were in flight after their command, and how much of the workers'
    compute ran meanwhile (overlapped with communication).

(g) step capture (issue #12 item 2): user-thread time per training step of the Llama DPxTP example (2x2 mesh,
    20 steps, AdamW with foreach=True in DTorch and plain torch alike: its default on a CUDA mesh): eager
    (automatic capture off), `dtorch.compile` (steps 3-20 replayed: one InstrReplay each), automatic capture
    (the default: the same loop, no step marked, each upload ends a step) and "graph + replay" (the forward
    and backward under `dtorch.compile(mode="graph")`, whose Python does not run from step 4 on, and AdamW's
    step, whose step sizes are computed in Python, replayed) and the whole step as a graph with
    `dtorch.optim.AdamW` (its step counters on the workers), against plain torch eager's whole step on one
    process (one intra-op thread); then the same with SGD + momentum (no number changes from step to step), the
    whole step under mode="graph". The losses of every DTorch run must be identical to eager DTorch's with the
    same optimizer;
(h) random factories (issue #12 item 4): time and elements drawn per device for a 4096x4096 randn sharded
    over 1-8 devices, block-seeded (each device draws the blocks of its shard) against drawing the whole
    tensor and keeping the box (what workers did before).

(i) FSDP: a training step (forward, backward, SGD) of 4 residual blocks (LayerNorm, Linear 512->2048, ReLU, Linear
    2048->512) and a head, `fully_shard` per block and then on the root, as FSDP2's recipe, batch 64 sharded over
    2 devices (each torch rank its 32 rows), loss on the client, against torch's own FSDP2 (`fully_shard`) on 2
    gloo ranks; with each step's all_gathers and reduce_scatters (DTorch's `CommDebugMode`, and torch's own on
    rank 0).

Figures are medians of `--repeats` runs; ratios are DTorch / peer (below 1.0x: DTorch is faster).
Each worker and each torch rank uses one intra-op thread; plain torch uses as many as there are ranks.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

HIDDEN, BATCH, LAYERS = 1024, 64, 4
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
TP_PLAN_KEYS = ("0", "2", "4", "6")  # Linear layers of the Sequential below: colwise, rowwise, colwise, rowwise


# ---------------------------------------------------------------------------- shared model and timing


def make_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        layers.append(nn.Linear(HIDDEN, HIDDEN))
        layers.append(nn.ReLU() if i < LAYERS - 1 else nn.Identity())
    return nn.Sequential(*layers)


FSDP_HIDDEN, FSDP_BLOCKS = 512, 4


def make_fsdp_model(seed: int = 0) -> nn.Sequential:
    """(i): residual MLP blocks and a head (each block one `fully_shard` call, as FSDP2's recipe)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.up, self.down = (nn.LayerNorm(FSDP_HIDDEN), nn.Linear(FSDP_HIDDEN, 4 * FSDP_HIDDEN),
                                             nn.Linear(4 * FSDP_HIDDEN, FSDP_HIDDEN))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(self.norm(x))))

    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(FSDP_BLOCKS)], nn.Linear(FSDP_HIDDEN, FSDP_HIDDEN))


def fully_sharded(model: nn.Sequential, fully_shard: Callable[..., Any], mesh: Any) -> nn.Sequential:
    """(i): FSDP2's recipe, with torch's `fully_shard` or DTorch's: each block, then the root."""
    for block in model[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_batch(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, FSDP_HIDDEN, generator=g), torch.randn(BATCH, FSDP_HIDDEN, generator=g)


def comm_counts(mode: Any) -> tuple[int, int]:
    """(all_gathers, reduce_scatters) a CommDebugMode (torch's or DTorch's) counted."""
    counts = {str(k).rsplit(".", 1)[-1]: v for k, v in mode.get_comm_counts().items()}
    gathers = sum(v for k, v in counts.items() if "all_gather" in k or "allgather" in k)
    return gathers, sum(v for k, v in counts.items() if "reduce_scatter" in k)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, HIDDEN, generator=g), torch.randn(BATCH, HIDDEN, generator=g)


def sgd_step(model: nn.Module, inp: torch.Tensor, target: torch.Tensor) -> Callable[[], float]:
    """One training step (forward, MSE loss, backward, SGD) with the loss back on the caller: what (c) and (f) time."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        loss = ((model(inp) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2, before: Callable[[], object] | None = None
              ) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def per_op_us(loop: Callable[[int], object], args: argparse.Namespace, before: Callable[[], object] | None = None,
              after: Callable[[object], object] | None = None) -> dict[str, float]:
    """(a): `loop(n)` runs n ops back to back; medians over --repeats loops of --iters ops, per op in us: wall
    ("a"), the user thread's CPU ("a_cpu") and, with `after` (a sync point on what the loop returned), the time
    to its end ("a_total")."""
    walls, cpus, totals = [], [], []
    for _ in range(args.repeats):
        if before is not None:
            before()
        t0, c0 = time.perf_counter(), time.thread_time()
        y = loop(args.iters)
        walls.append((time.perf_counter() - t0) / args.iters * 1e6)
        cpus.append((time.thread_time() - c0) / args.iters * 1e6)
        if after is not None:
            after(y)
            totals.append((time.perf_counter() - t0) / args.iters * 1e6)
    out = {"a": statistics.median(walls), "a_cpu": statistics.median(cpus)}
    if totals:
        out["a_total"] = statistics.median(totals)
    return out


def _adds(x: Any, one: Any) -> Callable[[int], Any]:
    """(a)'s loop: x + one + one ... (both as locals of the loop's frame, as in a user's loop)."""
    def loop(n: int, y: Any = x, one: Any = one) -> Any:
        for _ in range(n):
            y = y + one
        return y
    return loop


# (d): untimed bursts first, for both contenders, so that the figure is a steady state: on a VM, memory a process
# touches for the first time can cost ~30 us a 4 KiB page (the host backs it then), and a worker's first ~10 ops of a
# new size touch fresh memory (outputs, and the recovery snapshot's copies of the new tensors): 64 MiB all_reduces
# took 920, 450, 420, 400 ms, then 60-70 ms
D_WARMUP = 8


def repeats_for(nbytes: int, repeats: int) -> int:
    """Fewer repeats for the big sizes: the figure is a bandwidth, five samples of a second are plenty."""
    return max(5, min(repeats, (64 << 20) // max(nbytes, 1)))


def burst(nbytes: int) -> int:
    """(d): ops issued back to back per timing, so a figure is a bandwidth, not one op's round trips."""
    return max(1, min(8, (64 << 20) // max(nbytes, 1)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a process has used so far; 0.0 where /proc cannot say."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def cluster_processes() -> dict[str, int]:
    """The embedded local cluster's processes (children of this one): role -> pid."""
    out: dict[str, int] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            if ppid != os.getpid():
                continue
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except (OSError, ValueError, IndexError):
            continue
        role = "controller" if b"dtorch_controller" in cmd else "worker" if b"dtorch_worker" in cmd else ""
        if role:
            out[f"{role} {sum(r.startswith(role) for r in out)}" if role == "worker" else role] = pid
    return out


CPU_CALLS = 40  # calls per CPU figure of (b) and (c): /proc counts another process's CPU in 10 ms ticks


def cpu_per_call(fn: Callable[[], object], calls: int, pids: dict[str, int]) -> dict[str, float]:
    """Run `fn` `calls` times; CPU ms per call of this process ("client") and of each of `pids`."""
    before = {role: process_cpu_s(pid) for role, pid in pids.items()}
    mine = time.process_time()
    for _ in range(calls):
        fn()
    out = {"client": (time.process_time() - mine) / calls * 1e3}
    out.update({role: (process_cpu_s(pid) - before[role]) / calls * 1e3 for role, pid in pids.items()})
    return out


def fmt_load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.1f}" for x in load)


def fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


# ---------------------------------------------------------------------------- torch: SPMD on 2 ranks


def _torch_rank(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:  # noqa: ANN001
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    device = "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh(args.device, (world,))
    out: dict[str, object] = {}

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    if "a" in args.only:
        x = distribute_tensor(torch.zeros(1, device=device), mesh, [Replicate()])
        one = distribute_tensor(torch.ones(1, device=device), mesh, [Replicate()])
        _ = x + one  # warm: the op's sharding cached
        out.update(per_op_us(_adds(x, one), args, before=dist.barrier, after=lambda _y: sync()))

    if "b" in args.only or "c" in args.only:
        model = make_mlp().to(device)
        style = {k: (ColwiseParallel() if i % 2 == 0 else RowwiseParallel()) for i, k in enumerate(TP_PLAN_KEYS)}
        parallelize_module(model, mesh, style)
        inp, target = (t.to(device) for t in batch())

        def forward() -> torch.Tensor:
            y = model(inp)  # RowwiseParallel hands back the replicated local tensor: every rank holds the value
            if isinstance(y, AsyncCollectiveTensor):
                y = y.wait()  # the all-reduce is waited at first use: the value is there only now
            sync()
            return y

        if "b" in args.only:
            with torch.no_grad():
                out["b"] = median_ms(forward, args.repeats, before=dist.barrier)
                out["b_cpu"] = _ranks_cpu(forward, CPU_CALLS)
                value = forward()
            out["b_value"] = value.cpu().tolist() if rank == 0 else None  # a tensor in a queue needs its sender
        if "c" in args.only:
            step = sgd_step(model, inp, target)
            out["c"] = median_ms(step, args.repeats, before=dist.barrier)
            out["c_cpu"] = _ranks_cpu(step, CPU_CALLS)

    if "d" in args.only:
        bw: dict[str, dict[int, float]] = {"all_reduce": {}, "all_gather": {}}
        # torch 2.13 renamed all_gather_into_tensor (deprecated there); the GPU image's torch 2.11 has only that name
        gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        for n in args.sizes:
            t = torch.ones(n // 4, device=device)
            part = torch.ones(n // 4 // world, device=device)  # all_gather of n bytes in all: n / world per rank
            reps = repeats_for(n, args.repeats)

            k = burst(n)

            def all_reduce(t: torch.Tensor = t, k: int = k) -> None:
                for _ in range(k):
                    dist.all_reduce(t)
                sync()

            def all_gather(t: torch.Tensor = t, part: torch.Tensor = part, k: int = k) -> None:
                for _ in range(k):
                    gather_into(t, part)
                sync()

            bw["all_reduce"][n] = median_ms(all_reduce, reps, warmup=D_WARMUP, before=dist.barrier) / k
            bw["all_gather"][n] = median_ms(all_gather, reps, warmup=D_WARMUP, before=dist.barrier) / k
            del t, part
        out["d"] = bw

    if "i" in args.only:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.debug import CommDebugMode

        model = fully_sharded(make_fsdp_model().to(device), fully_shard, mesh)
        inp, target = (t.chunk(world)[rank].to(device) for t in fsdp_batch())
        step = sgd_step(model, inp, target)  # (each rank's loss is its half's mean: FSDP2 averages the gradients)
        out["i"] = median_ms(step, args.repeats, before=dist.barrier)
        with CommDebugMode() as comm:
            step()
        out["i_comm"] = comm_counts(comm)

    dist.barrier()
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def _ranks_cpu(fn: Callable[[], object], calls: int) -> dict[str, float]:
    """Run `fn` `calls` times on every rank; CPU ms per call of each rank (a collective: every rank calls it)."""
    dist.barrier()
    cpu = time.process_time()
    for _ in range(calls):
        fn()
    cpus = [None] * dist.get_world_size()
    dist.all_gather_object(cpus, (time.process_time() - cpu) / calls * 1e3)
    return {f"rank {r}": c for r, c in enumerate(cpus)}


def run_torch(args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_torch_rank, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=1800)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return result


# ---------------------------------------------------------------------------- plain torch


def run_plain(args: argparse.Namespace) -> dict:
    torch.set_num_threads(2 if args.device == "cpu" else torch.get_num_threads())
    device = "cuda:0" if args.device == "cuda" else "cpu"
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    out: dict[str, object] = {}
    if "a" in args.only:
        out.update(per_op_us(_adds(torch.zeros(1, device=device), torch.ones(1, device=device)), args))
    model = make_mlp().to(device)
    inp, target = (t.to(device) for t in batch())
    if "b" in args.only:
        out["b"] = median_ms(lambda: (model(inp), sync()), args.repeats)
        out["b_value"] = model(inp).detach().cpu()
    if "c" in args.only:
        step = sgd_step(model, inp, target)
        out["c"] = median_ms(step, args.repeats)
    if "i" in args.only:
        out["i"] = median_ms(sgd_step(make_fsdp_model().to(device), *(t.to(device) for t in fsdp_batch())),
                             args.repeats)
    return out


# ---------------------------------------------------------------------------- DTorch


def run_dtorch(args: argparse.Namespace) -> dict:
    import dtorch
    from dtorch import Partial, Replicate, Shard
    from dtorch.nn import ColwiseParallel, RowwiseParallel, parallelize_module

    if args.device == "cuda":
        os.environ["DTORCH_LOCAL_DEVICE"] = "cuda"
    out: dict[str, object] = {}
    dtorch.connect(workers=2, auto_compile=args.auto_compile == "on")
    mesh = dtorch.DeviceMesh(args.device, [0, 1])
    if "a" in args.only:
        x = dtorch.zeros(1, device_mesh=mesh, placements=[Replicate()])
        one = dtorch.ones(1, device_mesh=mesh, placements=[Replicate()])
        (x + one).to_torch()  # warm: mesh placed, plan cached

        def check(y: Any) -> None:  # the values, back on the client: the time to here is "incl. execution"
            if (got := y.to_torch().item()) != args.iters + 0.0:
                raise AssertionError(f"(a): dtorch computed {got}, expected {args.iters}")

        out.update(per_op_us(_adds(x, one), args, after=check))

    if "b" in args.only or "c" in args.only:
        model = make_mlp()
        style = {k: (ColwiseParallel() if i % 2 == 0 else RowwiseParallel()) for i, k in enumerate(TP_PLAN_KEYS)}
        parallelize_module(model, mesh, style)
        inp_t, target_t = batch()
        inp = dtorch.distribute_tensor(inp_t, mesh, [Replicate()])
        target = dtorch.distribute_tensor(target_t, mesh, [Replicate()])
        session = dtorch.runtime.get_session()
        if "b" in args.only:
            with torch.no_grad():
                out["b"], out["b_late"] = early_and_late(session, lambda: model(inp).to_torch(), args.repeats)
                out["b_cpu"] = cpu_per_call(lambda: model(inp).to_torch(), CPU_CALLS, cluster_processes())
                out["b_value"] = model(inp).to_torch()
                more = 2 * int(os.environ.get("DTORCH_SNAPSHOT_BATCHES", "32")) + 8
                for _ in range(more):
                    model(inp).to_torch()  # two snapshots at least, the first one after the model is there
                (me,) = dtorch.status().sessions  # recovery's copies of a forward-only loop (lineage.py rule 5)
                out["b_snapshot"] = (more, me.snapshot_bytes, me.snapshot_copied_bytes)
        if "c" in args.only:
            step = sgd_step(model, inp, target)
            out["c"], out["c_late"] = early_and_late(session, step, args.repeats)
            out["c_cpu"] = cpu_per_call(step, CPU_CALLS, cluster_processes())

    if "d" in args.only:
        bw: dict[str, dict[int, float]] = {"all_reduce": {}, "all_gather": {}, "all_reduce_one": {}}
        session = dtorch.runtime.get_session()
        for n in args.sizes:
            reps = repeats_for(n, args.repeats)
            partial = dtorch.ones(n // 4, device_mesh=mesh, placements=[Partial()])
            sharded = dtorch.ones(n // 4, device_mesh=mesh, placements=[Shard(0)])
            session.sync()

            def move(src, placements, k) -> None:  # noqa: ANN001
                ys = [src.redistribute(placements=placements) for _ in range(k)]
                session.sync()
                del ys

            k = burst(n)
            bw["all_reduce"][n] = median_ms(lambda src=partial, k=k: move(src, [Replicate()], k), reps,
                                            warmup=D_WARMUP) / k
            bw["all_gather"][n] = median_ms(lambda src=sharded, k=k: move(src, [Replicate()], k), reps,
                                            warmup=D_WARMUP) / k
            bw["all_reduce_one"][n] = median_ms(lambda src=partial: move(src, [Replicate()], 1), reps,
                                                warmup=D_WARMUP)
            del partial, sharded
        out["d"] = bw
    if "i" in args.only:
        from dtorch.debug import CommDebugMode
        from dtorch.nn import fully_shard

        model = fully_sharded(make_fsdp_model(), fully_shard, mesh)
        inp, target = (dtorch.distribute_tensor(t, mesh, [Shard(0)]) for t in fsdp_batch())
        step = sgd_step(model, inp, target)
        out["i"] = median_ms(step, args.repeats)
        with CommDebugMode() as comm:
            step()
        out["i_comm"] = comm_counts(comm)
    dtorch.shutdown()

    if "e" in args.only:
        gpus = torch.cuda.device_count() if args.device == "cuda" else 4  # one worker per GPU
        out["e"] = {n: received_per_device(n, args.device) for n in (2, 4) if n <= gpus}
    if "f" in args.only:
        out["f"] = {mode: dp_step(args, sync=(mode == "waited")) for mode in ("overlapped", "waited")}
    return out


PROFILED_STEPS = 3


def early_and_late(session: Any, fn: Callable[[], object], repeats: int, warmup: int = 2) -> tuple[float, float]:
    """`fn`'s median time in ms with early reads (dtorch/session.py), and with reads after the Sync's answer (as
    before them), the two in turns call by call."""
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for i in range(2 * (warmup + repeats)):
            session.early_reads = early = i % 2 == 0
            t0 = time.perf_counter()
            fn()
            if i >= 2 * warmup:
                times[early].append(time.perf_counter() - t0)
    finally:
        session.early_reads = True
    return statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3


def in_flight(records: list) -> tuple[float, float]:  # noqa: ANN001 (OpRecords of one worker)
    """Seconds one worker's collectives were in flight after their commands ended (issued, not landed yet), and
    seconds of its compute commands that ran meanwhile."""
    spans = sorted((r.start + r.seconds, r.landed) for r in records
                   if r.op == "collective" and r.landed > r.start + r.seconds)
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    flying = sum(b - a for a, b in merged)
    overlapped = sum(max(0.0, min(r.start + r.seconds, b) - max(r.start, a))
                     for r in records if not r.comm for a, b in merged)
    return flying, overlapped


def dp_step(args: argparse.Namespace, sync: bool) -> dict[str, float]:
    """A DP=2 training step: its median time, then (profiled) per step and worker, ms of collectives in flight
    and ms of compute run meanwhile; with `sync`, workers wait for each collective where it is issued."""
    import dtorch
    from dtorch import Shard
    from dtorch.nn import parallelize_module

    os.environ["DTORCH_SYNC_COLLECTIVES"] = "1" if sync else "0"
    try:
        dtorch.connect(workers=2)
        mesh = dtorch.DeviceMesh(args.device, [0, 1], mesh_dim_names=("dp",))
        model = parallelize_module(make_mlp(), mesh, {})
        g = torch.Generator().manual_seed(3)
        inp = dtorch.distribute_tensor(torch.randn(256, HIDDEN, generator=g), mesh, [Shard(0)])
        target = dtorch.distribute_tensor(torch.randn(256, HIDDEN, generator=g), mesh, [Shard(0)])
        step = sgd_step(model, inp, target)
        out = {"ms": median_ms(step, args.repeats)}
        with dtorch.profile() as p:
            for _ in range(PROFILED_STEPS):
                step()
        per_worker = [in_flight(records) for records in p.report.records.values()]
        n = max(len(per_worker), 1) * PROFILED_STEPS
        out["flying_ms"] = sum(f for f, _ in per_worker) / n * 1e3
        out["overlapped_ms"] = sum(o for _, o in per_worker) / n * 1e3
        return out
    finally:
        dtorch.shutdown()
        os.environ.pop("DTORCH_SYNC_COLLECTIVES", None)


def received_per_device(devices: int, device_type: str = "cpu", nbytes: int = 4 << 20) -> dict[str, float]:
    """Bytes each worker received for one Partial -> Replicate of `nbytes` on `devices` devices (1 per worker)."""
    import dtorch
    from dtorch import Partial, Replicate

    dtorch.connect(workers=devices)
    try:
        mesh = dtorch.DeviceMesh(device_type, list(range(devices)))
        x = dtorch.ones(nbytes // 4, device_mesh=mesh, placements=[Partial()])
        x._session.sync()

        def counters() -> dict[str, int]:
            return {w.worker: getattr(w, "received_bytes", -1) for w in dtorch.status().workers}

        time.sleep(0.5)  # a report carries the counters
        before = counters()
        y = x.redistribute(placements=[Replicate()])
        y._session.sync()
        time.sleep(0.5)
        after = counters()
        plane, pulled = x._session._data, []  # the client's Pulls of a read of x: one copy, or one per device
        pull = plane._pull
        plane._pull = lambda tid, device, n, after=-1: (pulled.append(n), pull(tid, device, n, after))[1]
        x.to_torch()
        plane._pull = pull
        got = [after[w] - before[w] for w in after if after[w] >= 0]
        if not got:  # workers without the counter: count what the point-to-point plan pulls
            got = [float((devices - 1) * nbytes)] * devices
            return {"max": max(got), "mean": statistics.mean(got), "measured": 0.0, "read": sum(pulled)}
        return {"max": max(got), "mean": statistics.mean(got), "measured": 1.0, "read": sum(pulled)}
    finally:
        dtorch.shutdown()


# ---------------------------------------------------------------------------- (g) step capture, (h) factories

LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def llama_step_times(steps: int, how: str, optimizer: str = "adamw") -> tuple[list[float], list[float]]:
    """(user-thread seconds per step, losses) of the DPxTP Llama example: DTorch "eager", "compiled"
    (`dtorch.compile`), "graph" (`dtorch.compile(mode="graph")`), "auto" (automatic capture, the loop unmarked)
    or "plain" torch (one process); AdamW, or SGD with momentum."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    if how != "plain":
        import dtorch
        from dtorch import Replicate, Shard
        from dtorch.nn import llama_tp_plan, parallelize_module

        mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh, llama_tp_plan(), tp_mesh_dim="tp")
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True) if optimizer == "adamw"
           else dtorch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer == "dtorch-adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))

    def body(ids):  # noqa: ANN001, ANN202
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    def forward_backward(ids):  # noqa: ANN001, ANN202
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss

    if how == "split":  # the model's part a graph, the optimizer's step (numbers in Python) a replay
        graphed, opt_step = dtorch.compile(forward_backward, mode="graph"), dtorch.compile(opt.step)

        def step(ids):  # noqa: ANN001, ANN202
            loss = graphed(ids)
            opt_step()
            return loss
    else:
        step = dtorch.compile(body) if how == "compiled" else dtorch.compile(body, mode="graph") if how == "graph" \
            else body
    if how != "plain":
        dtorch.auto_compile(False)  # a fresh one (its counts are this run's), or off
        auto = dtorch.auto_compile(how == "auto")
    data = torch.Generator().manual_seed(1)
    times, losses = [], []
    for _ in range(steps):
        ids = torch.randint(0, LLAMA["vocab_size"], (4, 16), generator=data)
        if how != "plain":
            ids = dtorch.distribute_tensor(ids, mesh, [Shard(0), Replicate()])
        t0 = time.thread_time()
        losses.append(step(ids))
        times.append(time.thread_time() - t0)
    if how == "split":
        assert (graphed.graphed, opt_step.replays) == (steps - 3, steps - 2), (graphed.no_graph, opt_step.fallbacks)
    if how in ("compiled", "graph"):
        assert step.replays == steps - 2, (step.replays, step.fallbacks, step.unreplayable)
        assert how == "compiled" or step.graphed == steps - 3, (step.graphed, step.no_graph)
    losses = [float(loss.item()) for loss in losses]
    if how == "auto":  # steps 1-3 eager (1 makes AdamW's state), 4 recorded, 5.. replayed, each ended by the next
        assert (auto.replays, auto.fallbacks) == (steps - 4, 0), (auto.replays, auto.fallbacks)  # upload
    return times, losses


def run_capture(args: argparse.Namespace) -> dict:
    import dtorch

    # plain torch on one intra-op thread: at this model size (hidden 32) a step is Python and dispatch, a second
    # thread buys nothing, and on a shared 2-core machine OpenMP's spinning worker would count as the step's time
    torch.set_num_threads(1)
    plain, _ = llama_step_times(args.steps, "plain")
    sgd_plain, _ = llama_step_times(args.steps, "plain", "sgd")
    os.environ.pop("DTORCH_LOCAL_DEVICE", None)  # CPU workers whatever --device: the client's capture against plain
    dtorch.connect(workers=2)                    # torch on this CPU, on a mesh of "cpu" devices
    try:
        eager, eager_losses = llama_step_times(args.steps, "eager")
        captured, captured_losses = llama_step_times(args.steps, "compiled")
        auto, auto_losses = llama_step_times(args.steps, "auto")
        sgd_eager, sgd_eager_losses = llama_step_times(args.steps, "eager", "sgd")
        graph, graph_losses = llama_step_times(args.steps, "graph", "sgd")
        split, split_losses = llama_step_times(args.steps, "split")
        whole, whole_losses = llama_step_times(args.steps, "graph", "dtorch-adamw")
        whole_eager, whole_eager_losses = llama_step_times(args.steps, "eager", "dtorch-adamw")
    finally:
        dtorch.shutdown()
    tail, graphed = slice(2, None), slice(3, None)  # steps 3.. : warmed up, compiled ones replayed; 4.. : graphs
    return {"plain": statistics.median(plain[tail]) * 1e3, "eager": statistics.median(eager[tail]) * 1e3,
            "captured": statistics.median(captured[tail]) * 1e3, "auto": statistics.median(auto[tail]) * 1e3,
            "diff": max(abs(a - b) for a, b in zip(eager_losses, captured_losses)),
            "auto_diff": max(abs(a - b) for a, b in zip(eager_losses, auto_losses)),
            "sgd_plain": statistics.median(sgd_plain[graphed]) * 1e3,
            "sgd_eager": statistics.median(sgd_eager[graphed]) * 1e3, "graph": statistics.median(graph[graphed]) * 1e3,
            "split": statistics.median(split[graphed]) * 1e3, "whole": statistics.median(whole[graphed]) * 1e3,
            "whole_diff": max(abs(a - b) for a, b in zip(whole_eager_losses, whole_losses)),
            "whole_vs_torch": max(abs(a - b) for a, b in zip(eager_losses, whole_losses)),
            "split_diff": max(abs(a - b) for a, b in zip(eager_losses, split_losses)),
            "graph_diff": max(abs(a - b) for a, b in zip(sgd_eager_losses, graph_losses))}


def run_factories(args: argparse.Namespace) -> dict[int, tuple[float, float, int]]:
    """devices -> (ms block-seeded, ms whole tensor, elements drawn per device), for device 0's shard."""
    from dtorch_protocol.layout import shard_box
    from dtorch_protocol.placement_types import Shard
    from dtorch_worker import random_blocks

    torch.set_num_threads(1)
    shape, out = (4096, 4096), {}
    for n in (1, 2, 4, 8):
        box = [list(b) for b in shard_box(shape, (n,), (Shard(0),), (0,))]
        ours = median_ms(lambda box=box: random_blocks.draw("randn", 7, shape, box, torch.float32), args.repeats)
        whole = median_ms(lambda box=box: torch.randn(shape, generator=torch.Generator().manual_seed(7))
                          .narrow(0, box[0][0], box[0][1]).clone(), args.repeats)
        out[n] = (ours, whole, box[0][1] * shape[1])
    return out


# ---------------------------------------------------------------------------- report


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "   n/a"
    return f"{a / b:5.2f}x"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--iters", type=int, default=5000, help="(a): loop length")
    p.add_argument("--quick", action="store_true", help="(d): 4 sizes up to 16 MiB")
    p.add_argument("--only", default="a,b,c,d,e,f,g,h,i", help="comma-separated items to run")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=1, help="(a)-(d): the three contenders measured this many times, "
                   "in turns; figures are medians over the rounds and ratios are medians of each round's ratios, "
                   "printed with their range (on a shared machine the load moves between one contender and the next)")
    p.add_argument("--steps", type=int, default=20, help="(g): training steps per run")
    p.add_argument("--auto-compile", choices=("on", "off"), default="on",
                   help="(a)-(e): DTorch's automatic capture (on by default for users; off: every op eager)")
    args = p.parse_args()
    args.only = set(args.only.split(","))
    args.sizes = QUICK_SIZES if args.quick else SIZES
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("bench_vs_torch --device cuda needs 2 CUDA devices")

    load_before = os.getloadavg()
    plain = run_plain(args)
    torch_dt = run_torch(args) if args.only & {"a", "b", "c", "d", "i"} else {}
    dt = run_dtorch(args) if args.only & {"a", "b", "c", "d", "e", "f", "i"} else {}
    rounds = [(plain, torch_dt, dt)]
    turns = argparse.Namespace(**{**vars(args), "only": args.only & {"a", "b", "c", "d"}})
    for _ in range(args.rounds - 1 if turns.only else 0):
        rounds.append((run_plain(turns), run_torch(turns), run_dtorch(turns)))

    def med(who: int, key: str) -> float:
        return statistics.median(r[who][key] for r in rounds)

    def rat(key: str, peer: int) -> str:  # DTorch / peer: the median of the rounds' ratios, and their range
        ratios = sorted(r[2][key] / r[peer][key] for r in rounds)
        return f"{statistics.median(ratios):5.2f}x" + (f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(rounds) > 1
                                                        else "")

    def print_cpu(key: str, what: str) -> None:  # CPU per call of every process, summed over all: a floor on 2 cores
        for who, cpu in (("dtorch", dt[f"{key}_cpu"]), ("torch DTensor", torch_dt[f"{key}_cpu"])):
            parts = ", ".join(f"{role} {ms:.2f}" for role, ms in cpu.items())
            print(f"    CPU ms per {what}, {who}{' (round 1)' if len(rounds) > 1 else ''}: {sum(cpu.values()):.2f} "
                  f"in all ({parts}); "
                  f"on {os.cpu_count()} CPUs no {what} takes less than {sum(cpu.values()) / os.cpu_count():.2f} ms")

    capture = run_capture(args) if "g" in args.only else {}
    factories = run_factories(args) if "h" in args.only else {}

    print(f"\nDTorch vs torch DTensor (2 {'gloo' if args.device == 'cpu' else 'NCCL'} ranks) vs plain torch "
          f"(torch {torch.__version__}, device {args.device}, medians of {args.repeats}"
          + (f"; (a)-(d) over {len(rounds)} rounds, the contenders in turns)" if len(rounds) > 1 else ")"))
    print(f"load average (1, 5, 15 min) at the start {fmt_load(load_before)}, at the end {fmt_load(os.getloadavg())} "
          f"on {os.cpu_count()} CPUs: figures from a loaded machine are noise beyond their order of magnitude")
    if "a" in args.only:
        print(f"(a) shape-(1,) add, user-thread time per op ({args.iters} iterations; wall, and the user thread's own "
              "CPU: DTorch's wall adds the waits for the GIL its sender thread holds while it encodes)")
        print(f"    dtorch            {med(2, 'a'):9.2f} us   CPU {med(2, 'a_cpu'):5.2f} us   (incl. execution "
              f"{med(2, 'a_total'):.2f} us)   target <= 5 us")
        print(f"    torch DTensor     {med(1, 'a'):9.2f} us   CPU {med(1, 'a_cpu'):5.2f} us   "
              f"dtorch/DTensor {rat('a', 1)}   (CPU {rat('a_cpu', 1)})")
        print(f"    plain torch       {med(0, 'a'):9.2f} us   CPU {med(0, 'a_cpu'):5.2f} us   "
              f"dtorch/plain   {rat('a', 0)}")
    if "b" in args.only:
        print(f"(b) {LAYERS}-layer {HIDDEN}x{HIDDEN} MLP forward, batch {BATCH}, TP=2, value on the client")
        print(f"    dtorch            {med(2, 'b'):9.2f} ms   (reads after the Sync, DTORCH_EARLY_READS=0: "
              f"{med(2, 'b_late'):.2f} ms)")
        print(f"    torch DTensor     {med(1, 'b'):9.2f} ms   dtorch/DTensor {rat('b', 1)}   (target <= 1.0x)")
        print(f"    plain torch       {med(0, 'b'):9.2f} ms   dtorch/plain   {rat('b', 0)}")
        print_cpu("b", "forward")
        more, held, copied = dt["b_snapshot"]
        print(f"    dtorch's recovery snapshot after {more} more forwards (one every "
              f"{os.environ.get('DTORCH_SNAPSHOT_BATCHES', 32)} batches): {held / 2**20:.2f} MiB held, "
              f"{copied / 2**20:.2f} MiB of it copied (unchanged weights keep the copies of the snapshot before)")
        err = (dt["b_value"] - plain["b_value"]).abs().max().item()
        err_t = (torch.tensor(torch_dt["b_value"]) - plain["b_value"]).abs().max().item()
        print(f"    max |difference| from plain torch: dtorch {err:.2e}, DTensor {err_t:.2e}")
    if "c" in args.only:
        print("(c) the same MLP, forward + backward + SGD step, TP=2, loss on the client")
        print(f"    dtorch            {med(2, 'c'):9.2f} ms   (reads after the Sync, DTORCH_EARLY_READS=0: "
              f"{med(2, 'c_late'):.2f} ms)")
        print(f"    torch DTensor     {med(1, 'c'):9.2f} ms   dtorch/DTensor {rat('c', 1)}   (target <= 1.0x)")
        print(f"    plain torch       {med(0, 'c'):9.2f} ms   dtorch/plain   {rat('c', 0)}")
        print_cpu("c", "step")
    if "d" in args.only:
        print("(d) bandwidth on 2 devices: MB/s of the whole tensor, ops issued back to back (up to 8 per sync); "
              "ratio = dtorch time / raw gloo time (target <= 1.25x, i.e. >= 0.8x the bandwidth, from 1 MiB)"
              + (f"; medians over {len(rounds)} rounds, raw gloo and DTorch in turns, and the ratios' range"
                 if len(rounds) > 1 else ""))
        for op, peer in (("all_reduce", "Partial -> Replicate"), ("all_gather", "Shard(0) -> Replicate")):
            print(f"    {op} ({peer})")
            print("      size        dtorch MB/s   raw MB/s   time ratio" +
                  ("   dtorch one op + sync" if op == "all_reduce" else ""))
            for n in args.sizes:
                a = statistics.median(r[2]["d"][op][n] for r in rounds)
                b = statistics.median(r[1]["d"][op][n] for r in rounds)
                ratios = sorted(r[2]["d"][op][n] / r[1]["d"][op][n] for r in rounds)
                spread = f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(rounds) > 1 else ""
                one = statistics.median(r[2]["d"]["all_reduce_one"][n] for r in rounds)
                one = f"   {one:9.2f} ms" if op == "all_reduce" else ""
                print(f"      {fmt_size(n):>8}   {n / a / 1e3:11.1f} {n / b / 1e3:10.1f}   "
                      f"{statistics.median(ratios):.2f}x{spread}{one}")
    if "e" in args.only:
        print("(e) bytes received per device, Partial -> Replicate of 4 MiB (target: O(size), not O(n x size))")
        for n, e in dt["e"].items():
            how = "measured" if e["measured"] else "from the point-to-point plan (workers count nothing)"
            print(f"    {n} devices: max {e['max'] / (4 << 20):5.2f}x the tensor, mean "
                  f"{e['mean'] / (4 << 20):5.2f}x  ({how}); a read of the Partial tensor on the client pulled "
                  f"{e.get('read', 0) / (4 << 20):5.2f}x the tensor")
    if "f" in args.only:
        f = dt["f"]
        print("(f) overlap: DP=2 training step of the MLP, batch 256, gradients all-reduced as they are accumulated")
        for mode, what in (("overlapped", "collectives in flight while computing"),
                           ("waited", "each collective waited for at issue  ")):
            print(f"    {what}  {f[mode]['ms']:9.2f} ms   per step and worker: collectives in flight after their "
                  f"command {f[mode]['flying_ms']:6.2f} ms, compute run meanwhile {f[mode]['overlapped_ms']:6.2f} ms")
        print(f"    overlapped / waited {ratio(f['overlapped']['ms'], f['waited']['ms'])} (on 2 shared CPU cores a "
              "transfer is CPU work too: overlap hides it only where a core would otherwise wait)")
    if "i" in args.only:
        print(f"(i) FSDP training step: {FSDP_BLOCKS} blocks ({FSDP_HIDDEN}->{4 * FSDP_HIDDEN}->{FSDP_HIDDEN}) and a "
              f"head, fully_shard per block and on the root, batch {BATCH} over 2 devices, loss on the client")
        for who, figures in (("dtorch", dt), ("torch FSDP2", torch_dt)):
            gathers, scatters = figures["i_comm"]
            print(f"    {who:<16}  {figures['i']:9.2f} ms   {gathers} all_gathers and {scatters} reduce_scatters per "
                  "step" + (f"   dtorch/FSDP2 {ratio(dt['i'], torch_dt['i'])}" if who == "dtorch" else ""))
        print(f"    plain torch       {plain['i']:9.2f} ms   dtorch/plain {ratio(dt['i'], plain['i'])}")
    if capture:
        print("(g) Llama DPxTP training step (2x2 mesh, AdamW foreach), user-thread time, median of steps "
              f"3-{args.steps}")
        print(f"    dtorch eager              {capture['eager']:9.2f} ms")
        print(f"    dtorch.compile (replayed) {capture['captured']:9.2f} ms   captured/eager "
              f"{ratio(capture['captured'], capture['eager'])}")
        print(f"    automatic capture         {capture['auto']:9.2f} ms   auto/eager "
              f"{ratio(capture['auto'], capture['eager'])}   (the same loop, no step marked)")
        print(f"    plain torch eager step    {capture['plain']:9.2f} ms   captured/plain "
              f"{ratio(capture['captured'], capture['plain'])}   (target <= 0.4x)")
        print(f"    graph + replay            {capture['split']:9.2f} ms   split/plain "
              f"{ratio(capture['split'], capture['plain'])}   (forward+backward mode='graph', AdamW's step replayed; "
              f"steps 4-{args.steps})")
        print(f"    graph, dtorch AdamW       {capture['whole']:9.2f} ms   whole/plain "
              f"{ratio(capture['whole'], capture['plain'])}   (the whole step mode='graph' with dtorch.optim.AdamW: "
              f"step counters on the workers)")
        print(f"    max |loss difference| eager vs captured: {capture['diff']:.1e}, vs auto: "
              f"{capture['auto_diff']:.1e}, vs graph + replay: {capture['split_diff']:.1e} (identical: 0); "
              f"dtorch.optim.AdamW graph vs its eager run {capture['whole_diff']:.1e} (identical: 0), vs torch's "
              f"AdamW {capture['whole_vs_torch']:.1e} (float rounding)")
        print(f"    the same with SGD + momentum, median of steps 4-{args.steps}:")
        print(f"    dtorch eager              {capture['sgd_eager']:9.2f} ms")
        print(f"    dtorch.compile graph      {capture['graph']:9.2f} ms   graph/eager "
              f"{ratio(capture['graph'], capture['sgd_eager'])}   (mode='graph': the step's Python does not run)")
        print(f"    plain torch eager step    {capture['sgd_plain']:9.2f} ms   graph/plain "
              f"{ratio(capture['graph'], capture['sgd_plain'])}   (target <= 0.4x)")
        print(f"    max |loss difference| eager vs graph: {capture['graph_diff']:.1e} (identical: 0)")
    if factories:
        print("(h) randn 4096x4096 float32, Shard(0): time and elements drawn by one device")
        print("    devices     blocks (ours)        whole tensor, then the box   elements drawn (ours / whole)")
        for n, (ours, whole, drawn) in factories.items():
            print(f"    {n:7d}   {ours:17.2f} ms   {whole:23.2f} ms   {drawn:>12,} / {4096 * 4096:,}")


if __name__ == "__main__":
    main()
