"""A small tensor-parallel MLP trained with AdamW on an embedded cluster, twice: without a fault, then with one.

    python integration/_fault_run.py MODE [--workers 3] [--steps 10] [--at 4] [--graph]

MODE: clean | kill (SIGKILL the worker of logical device 1 after step --at) | kill_in_collective (SIGSTOP it
after step --at, so the survivors' next all-reduce waits for it, then SIGKILL it half a second later, in the
middle of that all-reduce) | stop (SIGSTOP it instead;
SIGCONT it after the run: it must exit, fenced) | drain (drain it, from another thread, while training
goes on) | migrate (move logical device 1 to the spare worker, idem) | kill2 (SIGKILL two workers at
once: more than the copies survive) | kill_after_upload (the inputs are sharded, Shard(0), and the worker of
logical device 1 is SIGKILLed right after step --at + 1 uploaded them, before their copies for recovery are made:
the client is asked for them again). --graph: the step runs as a graph (`dtorch.compile(mode="graph")`, with
`dtorch.optim.AdamW`) in both runs. Prints one JSON line: the losses
and final weights of both runs, what happened, and timings. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import threading
import time

import torch
import torch.nn as nn

import dtorch
from dtorch import Replicate, Shard, runtime
from dtorch.nn import ColwiseParallel, RowwiseParallel, parallelize_module


def worker_pids() -> dict[str, int]:
    """Worker id -> pid of the embedded cluster's worker processes (from their logs)."""
    cluster = runtime.get_session().cluster
    out = {}
    for i, proc in enumerate(cluster.procs[1:]):
        text = (cluster.dir / f"worker{i}.log").read_text(errors="replace")
        found = re.search(r"dtorch-worker (w\d+) on", text)
        if found:
            out[found.group(1)] = proc.pid
    return out


def where(device: int) -> str:
    session = dtorch.runtime.get_session()
    status = dtorch.status()
    return next(s for s in status.sessions if s.session == session.id).devices[device]


def train(mesh, steps: int, at: int, action=None, box=None, preload=False, graph=False, after_upload=False,
          prepare=None):
    """`preload`: every batch is uploaded before the first step, so a step needs no upload (a stopped worker
    then holds up the collectives, not the client's uploads). `graph`: the step is a graph; returns how many
    calls ran as one in `box["graphed"]`. `after_upload`: the inputs are sharded, and `action` runs between the
    uploads of step `at` + 1 and its first op; `prepare`, after step `at`, so that nothing slow lies between those
    uploads and the action (a worker that got its adopts in the meantime would have copied its shards)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = (dtorch.optim.AdamW if graph else torch.optim.AdamW)(model.parameters(), lr=1e-2)

    def one_step(xd, yd):  # noqa: ANN001, ANN202
        loss = ((model(xd) - yd) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    step_fn = dtorch.compile(one_step, mode="graph") if graph else one_step
    gen = torch.Generator().manual_seed(5)
    data = [(torch.randn(12, 8, generator=gen), torch.randn(12, 8, generator=gen)) for _ in range(steps)]
    if preload:
        data = [(dtorch.distribute_tensor(x, mesh, [Replicate()]), dtorch.distribute_tensor(y, mesh, [Replicate()]))
                for x, y in data]
    losses = []
    layout = [Shard(0)] if after_upload else [Replicate()]
    for step in range(steps):
        x, y = data[step]
        xd = x if preload else dtorch.distribute_tensor(x, mesh, layout)
        yd = y if preload else dtorch.distribute_tensor(y, mesh, layout)
        if action is not None and after_upload and step == at + 1:
            action()
        losses.append(step_fn(xd, yd).item())
        if action is not None and not after_upload and step == at:
            action()
        if prepare is not None and step == at:
            prepare()
        if box is not None and box.get("slow"):
            time.sleep(0.4)  # leave the operator time to act during the run
            if step == steps - 2:  # and the last step waits until it has acted, however slow its commands are
                deadline = time.monotonic() + 120
                while not os.path.exists(box["done"]) and time.monotonic() < deadline:
                    time.sleep(0.05)
    weights = {name: p.to_torch().tolist() for name, p in model.named_parameters()}
    if graph and box is not None:
        box["graphed"] = step_fn.graphed
    return losses, weights


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--at", type=int, default=4)
    p.add_argument("--graph", action="store_true", help="the step as a graph (dtorch.compile(mode='graph'))")
    p.add_argument("--controller", default="", help="use a running controller (mode cli)")
    p.add_argument("--ready", default="", help="mode cli: write the session id here at step --at, then go slowly, "
                   "and take the last step once a file of that name + '.done' exists (the operator is done)")
    args = p.parse_args()
    dtorch.connect(args.controller or None, workers=args.workers)
    mesh = dtorch.DeviceMesh("cpu", [0, 1, 2])  # one logical device per worker (a 4th stays spare)
    preload = args.mode == "kill_in_collective"
    after_upload = args.mode == "kill_after_upload"
    clean_losses, clean_weights = train(mesh, args.steps, args.at, preload=preload, graph=args.graph,
                                        after_upload=after_upload)
    info: dict = {"mode": args.mode}

    def kill() -> None:
        victim = where(1)
        info["victim"] = victim
        info["t_kill"] = time.monotonic()
        os.kill(worker_pids()[victim], signal.SIGKILL)

    def cli() -> None:  # an operator acts from outside (dtorch-controller drain/migrate) while steps go on
        with open(args.ready + ".tmp", "w") as f:
            f.write(dtorch.runtime.get_session().id)
        os.replace(args.ready + ".tmp", args.ready)
        box["slow"], box["done"] = True, args.ready + ".done"

    def stop() -> None:
        victim = where(1)
        info["victim"] = victim
        info["pid"] = worker_pids()[victim]
        os.kill(info["pid"], signal.SIGSTOP)

    def find_victim() -> None:
        info["victim"] = where(1)
        info["pid"] = worker_pids()[info["victim"]]

    def kill_found() -> None:
        info["t_kill"] = time.monotonic()
        os.kill(info["pid"], signal.SIGKILL)

    def kill_in_collective() -> None:
        victim = where(1)
        info["victim"] = victim
        pid = worker_pids()[victim]
        os.kill(pid, signal.SIGSTOP)  # it issues nothing more: the survivors' next collective waits for it
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()

    def kill2() -> None:
        pids = worker_pids()
        victims = sorted({where(0), where(1)})
        info["victims"] = victims
        for v in victims:
            os.kill(pids[v], signal.SIGKILL)

    box: dict = {}

    def in_background(fn) -> None:
        def run() -> None:
            try:
                box["reply"] = fn()
            except Exception as e:  # noqa: BLE001 - reported in the JSON line
                box["error"] = f"{type(e).__name__}: {e}"
        t = threading.Thread(target=run)
        t.start()
        box["thread"] = t

    def drain() -> None:
        victim = where(1)
        info["victim"] = victim
        in_background(lambda: dtorch.drain(victim, timeout_s=60))

    def migrate() -> None:
        session = dtorch.runtime.get_session()
        status = dtorch.status()
        used = set(next(s for s in status.sessions if s.session == session.id).devices.values())
        spare = next(w.worker for w in status.workers if w.state == "alive" and w.worker not in used)
        info["to"] = spare
        info["from"] = where(1)
        in_background(lambda: dtorch.migrate(1, spare, timeout_s=60))

    action = {"clean": None, "kill": kill, "stop": stop, "kill2": kill2, "drain": drain, "migrate": migrate,
              "cli": cli, "kill_in_collective": kill_in_collective, "kill_after_upload": kill_found}[args.mode]
    t0 = time.monotonic()
    try:
        losses, weights = train(mesh, args.steps, args.at, action, box, preload=preload, graph=args.graph,
                                after_upload=after_upload, prepare=find_victim if after_upload else None)
        info["error"] = None
    except Exception as e:  # noqa: BLE001 - the unrecoverable case: one clear line
        losses, weights = [], {}
        info["error"] = f"{type(e).__name__}: {e}"
    info["seconds"] = time.monotonic() - t0
    info["graphed"] = box.get("graphed")
    if "thread" in box:
        box["thread"].join(90)
        reply = box.get("reply")
        info["admin_error"] = box.get("error")
        if reply is not None:
            info["admin"] = {"ok": reply.ok, "message": reply.message,
                             "moves": [{"from": mv.from_worker, "to": mv.to_worker, "devices": mv.devices,
                                        "bytes": mv.bytes, "downtime_s": mv.downtime_s} for mv in reply.moves]}
    if args.mode == "stop":  # woken up, the fenced worker learns it was declared lost and exits
        proc = next(p for p in runtime.get_session().cluster.procs if p.pid == info["pid"])
        os.kill(info["pid"], signal.SIGCONT)
        try:
            info["exit_code"] = proc.wait(20)
        except Exception:  # noqa: BLE001
            info["exit_code"] = None
    status = dtorch.status()
    info["events"] = status.events
    cluster = runtime.get_session().cluster  # None with --controller: the workers' logs are not ours to read
    info["worker_warnings"] = [line for i in range(len(cluster.procs) - 1)
                               for line in (cluster.dir / f"worker{i}.log").read_text(errors="replace")
                               .splitlines() if "WARNING" in line] if cluster is not None else []
    info["workers"] = {w.worker: w.state for w in status.workers}
    info["devices"] = next((s.devices for s in status.sessions if s.session == dtorch.runtime.get_session().id), {})
    print(json.dumps({"clean": [clean_losses, clean_weights], "run": [losses, weights], "info": info}))


if __name__ == "__main__":
    main()
