"""Controller throughput (issue #12 item 3), printed, never asserted: instructions per second through the real
controller core's `handle()` (no gRPC, a fake clock) for 1, 8 and 64 workers, eager batches against replays of
a captured program (`InstrReplay`), with and without decoding the Submit from its wire bytes.

A step is STEP instructions: elementwise ops over the mesh's devices (one InstrCall each, a new output from the
previous one and a parameter) and the deletes of the outputs. Eager: the step's instructions in one Submit.
Replay: the same step defined once as a program, then one Submit holding one InstrReplay. The first replay is
translated like the instructions and compiled (each worker is sent its commands once, CmdProgram); every later
one is a CmdReplay per worker and the session's registry updated (core/programs.py). Printed: eager ms per step
and instructions/s, the first replay's ms, a later replay's ms, and how many times cheaper than eager it is.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import msgspec

from dtorch_controller.core import Config, ControllerCore, counter_ids
from dtorch_controller.core import events as ev
from dtorch_protocol import messages as m
from dtorch_protocol.wire import hello

STEP = 2000


class Core:
    def __init__(self, workers: int) -> None:
        config = Config(heartbeat_interval_s=1e6, heartbeat_timeout_s=1e7, session_timeout_s=0.0)
        self.core = ControllerCore(config, session_ids=counter_ids("s"))
        self.now, self.rids, self.seq = 0.0, itertools.count(), 0
        for i in range(workers):
            self.call(ev.Register, m.RegisterWorker(hello=hello("worker"), address=f"10.0.{i // 256}.{i % 256}:7000",
                                                    device_type="cuda", memory_bytes=80 << 30,
                                                    labels={"node": f"n{i // 8}"}))
        self.sid = self.call(ev.OpenSession, m.OpenSession(hello=hello("client"))).session
        self.spec = m.TensorSpec(shape=[workers * 64], dtype="float32", mesh=0, placements=["S0"])
        assert self.call(ev.OpenMesh, m.OpenMesh(session=self.sid, mesh=0, devices=list(range(workers)),
                                                 shape=[workers])).placed
        self.submit([m.InstrCreate(tid=1, spec=self.spec, init="zeros")])

    def call(self, cls: type, msg: object) -> object:
        self.now += 1e-4
        rid = next(self.rids)
        for effect in self.core.handle(self.now, cls(rid, msg)):
            if getattr(effect, "request_id", None) == rid:
                return effect.message
        return None

    def submit(self, instrs: list, wire: bool = False) -> None:
        self.seq += 1
        msg = m.Submit(session=self.sid, seq=self.seq, instrs=instrs)
        if wire:  # what the server does with the bytes before handle()
            msg = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=m.Submit)
        assert self.call(ev.Submit, msg).accepted == self.seq
        for w in self.core.workers.values():  # every worker ran everything: nothing piles up
            w.completed = w.sent


def step(spec: m.TensorSpec, first: int, slots: bool) -> list:
    """STEP instructions: a chain of adds from tensor 1 (slot 0), then the deletes of the chain."""
    out, calls = [], STEP * 2 // 3
    base = 1 if slots else first
    prev = 0 if slots else 1
    for k in range(calls):
        tid = base + k
        out.append(m.InstrCall(op="aten.add.Tensor", mesh=0, args=[{"$t": prev}, {"$t": 0 if slots else 1}],
                               kwargs={}, outs=[m.OutSpec(tid, spec)], src="train.py:12"))
        prev = tid
    out.extend(m.InstrDelete(tids=[base + k]) for k in range(STEP - calls))
    return out


def measure(workers: int, repeats: int, wire: bool) -> tuple[float, float, float]:
    """(eager ms per step, the first replay's ms, a later replay's ms per step)."""
    c = Core(workers)
    eager, replay = [], []
    program = step(c.spec, 0, slots=True)
    ntids = 1 + STEP * 2 // 3
    c.submit([m.InstrDefine(program=1, instrs=program, ntids=ntids)])
    next_tid = 10
    for _ in range(repeats):
        instrs = step(c.spec, next_tid, slots=False)
        t0 = time.perf_counter()
        c.submit(instrs, wire)
        eager.append(time.perf_counter() - t0)
        c.submit([m.InstrDelete(tids=list(range(next_tid, next_tid + ntids)))])
        next_tid += ntids
        tids = [1, *range(next_tid, next_tid + ntids - 1)]
        t0 = time.perf_counter()
        c.submit([m.InstrReplay(program=1, tids=tids)], wire)
        replay.append(time.perf_counter() - t0)
        c.submit([m.InstrDelete(tids=tids[1:])])
        next_tid += ntids
    first = replay.pop(0)  # translated and compiled
    return statistics.median(eager) * 1e3, first * 1e3, statistics.median(replay) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    print(f"Controller throughput: a step of {STEP} instructions (adds over the mesh, deletes), medians of "
          f"{args.repeats}")
    print("  workers   how                 eager ms/step   eager instr/s   first replay ms   replay ms/step   "
          "eager/replay")
    for workers in (1, 8, 64):
        for wire in (False, True):
            e, first, r = measure(workers, args.repeats + 1, wire)
            how = "decode + handle()" if wire else "handle()"
            print(f"  {workers:7d}   {how:18s} {e:13.2f}   {STEP / e * 1e3:13,.0f}   {first:15.2f}   {r:14.3f}   "
                  f"{e / r:11.0f}x")


if __name__ == "__main__":
    main()
