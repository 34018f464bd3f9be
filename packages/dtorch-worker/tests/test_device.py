"""The device backend (device.py): the worker's one door to the hardware, and every host copy going through it."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch

from dtorch_protocol import auth, wire
from dtorch_protocol.messages import CmdCreate, Execute, PullRequest, ShardsChunk, ShardsRequest
from dtorch_protocol.values import host_bytes
from dtorch_worker import device as dev
from dtorch_worker import shards
from dtorch_worker.cli import parse_device
from dtorch_worker.device import CPU, MAPPED_FROM, DeviceBackend, backend_for
from dtorch_worker.server import start_worker
from dtorch_worker.transfer import byte_view, put_chunks, receive_chunks

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool,
          torch.complex64]


def test_cpu_backend_and_the_registry():
    b = backend_for("cpu")
    assert (b.type, b.comm, b.device) == ("cpu", "gloo", torch.device("cpu"))
    assert b.memory_bytes() > 0
    assert {"cpu", "cuda"} <= set(dev.device_types())
    with pytest.raises(ValueError, match=r"no backend for device type 'meta' \(registered: cpu, cuda"):
        backend_for("meta")
    with pytest.raises(ValueError, match="bad device 'gpu0'"):
        backend_for("gpu0")


_TUNED = """
import json, torch
from dtorch_worker.device import MAPPED_FROM, backend_for, fresh
backend_for("cpu").start()
def in_heap(t):
    p = t.untyped_storage().data_ptr()
    for line in open("/proc/self/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= p < hi:
            return line.rstrip().endswith("[heap]")
def huge_kib():
    return next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages"))
small, large = torch.ones(MAPPED_FROM - (1 << 20), dtype=torch.uint8), torch.ones(MAPPED_FROM, dtype=torch.uint8)
before = huge_kib()
ours = fresh(MAPPED_FROM, torch.uint8, torch.device("cpu")).fill_(1)
print(json.dumps({"small": in_heap(small), "large": in_heap(large), "ours": in_heap(ours),
                  "huge_kib": huge_kib() - before}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="reads Linux's /proc/self/maps")
def test_cpu_start_keeps_small_buffers_maps_large_ones_and_ours_take_huge_pages():
    """Rule 5, in a fresh process (the tuning is process-wide): buffers below MAPPED_FROM come from the heap (kept
    for reuse), larger ones are mapped and unmapped on their own (kept in the heap, they grew it by their size
    whenever no freed hole fit them), and the worker's own large buffers (`fresh`) are backed by transparent huge
    pages where the kernel allows it."""
    got = json.loads(subprocess.run([sys.executable, "-c", _TUNED], capture_output=True, text=True, check=True,
                                    timeout=60).stdout)
    assert (got["small"], got["large"], got["ours"]) == (True, False, False)
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        thp = "[never]"
    if "[never]" not in thp:
        assert got["huge_kib"] >= MAPPED_FROM // 2 // 1024


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_one_clear_line():
    with pytest.raises(SystemExit, match=r"bad --device 'cuda:1': torch sees no cuda device here"):
        parse_device("cuda:1")
    with pytest.raises(SystemExit, match=r"bad --device 'cpu:3': the cpu device has no index 3"):
        parse_device("cpu:3")


@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_round_trip_through_host_buffers_without_numpy(dtype):
    t = (torch.randn(5, 7) * 10).to(dtype)
    view = byte_view(t.t())  # not contiguous: a host copy is made
    back = CPU.from_bytes(bytes(view), dtype, [7, 5])
    assert torch.equal(back, t.t().contiguous())
    assert bytes(byte_view(t)) == bytes(host_bytes(t.contiguous()))


def test_conjugate_and_negative_views_are_resolved():
    z = torch.randn(4, dtype=torch.complex64)
    assert torch.equal(CPU.from_bytes(bytes(byte_view(z.conj())), torch.complex64, [4]), z.conj().resolve_conj())
    x = torch.randn(4, dtype=torch.complex64)
    neg = torch._neg_view(x)
    assert torch.equal(CPU.from_bytes(bytes(byte_view(neg)), torch.complex64, [4]), -x)


def test_a_byte_view_keeps_its_tensor_alive():
    view = host_bytes(torch.arange(1000, dtype=torch.int32))
    gc.collect()
    torch.ones(100_000)  # would reuse freed memory
    assert torch.equal(CPU.from_bytes(bytes(view), torch.int32, [1000]), torch.arange(1000, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous host tensor"):
        host_bytes(torch.ones(4, 4).t())


def test_seeded_restores_the_global_generator():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    with CPU.seeded(7):
        first = torch.rand(3)
    with CPU.seeded(7):
        assert torch.equal(torch.rand(3), first)
    assert torch.equal(torch.rand(3), expected)  # the global stream went on as if nothing happened


class CountingBackend(DeviceBackend):
    """A plugged-in backend that counts what goes through it."""

    calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        self._count("host_buffer")
        return super().host_buffer(nbytes)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        self._count("to_host")
        return super().to_host(t)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        self._count("to_device")
        return super().to_device(host)

    def activate(self) -> None:
        self._count("activate")


def test_a_plugged_in_backend_carries_every_host_copy_of_a_worker(monkeypatch):
    """Put, Pull and whole-shard copies go through the backend of the worker's device, nothing else."""
    monkeypatch.setitem(dev._REGISTRY, "cpu", CountingBackend)
    CountingBackend.calls = {}
    w = start_worker()
    try:
        assert isinstance(w.executor.backend, CountingBackend)
        stub = wire.Stub("dtorch.Worker", w.address, w.capability("s"))
        peer = wire.Stub("dtorch.Worker", w.address, w.capability("s", auth.PEER))
        stub.send_stream("Put", put_chunks("s", 1, 0, torch.arange(6.0)))
        assert CountingBackend.calls.get("host_buffer") == 1 and CountingBackend.calls.get("to_device") == 1
        back = receive_chunks(stub.stream("Pull", PullRequest(session="s", tid=1, device=0)), "pull")
        assert torch.equal(back, torch.arange(6.0)) and CountingBackend.calls.get("to_host") == 1
        w.executor.submit(Execute(seq=1, session="s", cmds=[CmdCreate(
            tid=2, dtype="float32", shape=[3], init="ones", boxes={0: [[0, 3]]})]))
        assert w.executor.wait_completed(1, 10.0)
        msgs = list(peer.stream("PullShards", ShardsRequest(session="s", devices={0: [2]})))
        assert CountingBackend.calls["to_host"] == 2 and CountingBackend.calls.get("activate") == 1
        _header, got = shards.receive([wire.decode(ShardsChunk, wire.encode(c)) for c in msgs],
                                      w.executor.backend)
        assert torch.equal(got[0][2], torch.ones(3)) and CountingBackend.calls["to_device"] == 2
        stub.close()
        peer.close()
    finally:
        w.stop()


@pytest.mark.parametrize("polled", [False, True], ids=["future", "polled"])
def test_a_collectives_completion_ends_when_it_is_done_or_when_set(polled):
    """Both completions a backend hands a lane, on real gloo Works of a 2-rank group in this process: the CPU's
    (the Work's future) and the accelerators' (`is_completed` polled: NCCL's future is done when the op is queued).
    Rank 1 holds back, so rank 0's all-reduce stays in flight: the wait times out, `set` (an abort) ends it, and
    once rank 1 joins in, a fresh completion sees the op done."""
    import datetime
    import threading

    import torch.distributed as dist

    store = dist.HashStore()
    pgs: dict[int, object] = {}

    def make(rank: int) -> None:
        pgs[rank] = CPU.new_group(dist.PrefixStore("t", store), rank, 2, 10.0, "127.0.0.1")

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    a, b = torch.ones(4), torch.full((4,), 2.0)
    work = pgs[0].allreduce([a])
    done = dev._Polled(work) if polled else CPU.completion(work)
    assert not done.wait(0.2) and not done.is_set()
    done.set()
    assert done.wait(0.0) and done.is_set()
    pgs[1].allreduce([b]).wait(datetime.timedelta(seconds=10))
    again = dev._Polled(work) if polled else CPU.completion(work)
    assert again.wait(10.0)
    work.wait()
    assert torch.equal(a, torch.full((4,), 3.0))
