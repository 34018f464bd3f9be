"""CUDA workers (`nox -s gpu_integration`): shards on the device, pinned host copies, NCCL collectives.

With one CUDA device: the backend's copies, a cuda worker's Put and Pull through same-host segments, its ops and
training against plain torch, a cuda and a cpu worker redistributing to each other, and a killed cuda worker rebuilt
with identical results (also under a graph step), and TP and DP x TP Llama training on two workers sharing the GPU.
With two or more: NCCL collectives, a TP MLP and DP x TP Llama training against torch. Each test says in one line
what it needs when the machine lacks it; on a machine without CUDA every one is skipped (and the session exits 0).
Scenarios run in their own processes (integration/_gpu_run.py, _fault_run.py), so each has its own cluster.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from _helpers import Keys, run_scenario, start_controller, start_worker, stop_all

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_cuda = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device: torch sees none on this machine")
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices: this machine has {GPUS}")
needs_transformers = pytest.mark.skipif(  # the Llama scenarios' model: an offline GPU image may lack it
    importlib.util.find_spec("transformers") is None, reason="needs transformers: not installed here")
TOL = 1e-4  # CUDA kernels round differently from the CPU's


@needs_cuda
def test_the_cuda_backend_copies_through_pinned_memory():
    from dtorch_protocol.values import host_bytes
    from dtorch_worker.device import backend_for

    b = backend_for("cuda:0")
    b.check()
    assert (b.type, b.comm) == ("cuda", "nccl") and b.memory_bytes() == torch.cuda.get_device_properties(0).total_memory
    assert b.host_buffer(64).is_pinned() and b.identity()
    t = torch.randn(33, 5, device="cuda:0")
    host = b.to_host(t.t())
    assert host.is_pinned() and host.device.type == "cpu" and torch.equal(host, t.t().cpu())
    back = b.from_bytes(bytes(host_bytes(host)), torch.float32, [5, 33])
    assert back.device == torch.device("cuda:0") and torch.equal(back, t.t())
    with b.seeded(3):
        first = torch.rand(4, device="cuda:0")
    with b.seeded(3):
        assert torch.equal(torch.rand(4, device="cuda:0"), first)


@needs_cuda
def test_a_cuda_worker_takes_and_gives_bytes_through_same_host_segments():
    from dtorch_protocol import segments, wire
    from dtorch_protocol.messages import PullRequest, PutChunk
    from dtorch_protocol.values import host_bytes, segment_tensor
    from dtorch_worker.server import start_worker as start_in_process

    w = start_in_process(device="cuda:0")
    value = torch.randn(1024, 1024)
    try:
        stub = wire.Stub("dtorch.Worker", w.address, w.capability("s"))
        seg = segments.for_put("s", 1, 0, [host_bytes(value)])
        stub.send_stream("Put", iter([PutChunk(session="s", tid=1, device=0, dtype="float32", shape=[1024, 1024],
                                               data=b"", segment=seg.name)]))
        seg.close()
        stored = w.store.get(("s", 1, 0))
        assert stored.device == torch.device("cuda:0") and torch.equal(stored.cpu(), value)
        reply = segments.for_pull("s", 1, 0, value.numel() * 4)
        (chunk,) = stub.stream("Pull", PullRequest(session="s", tid=1, device=0, segment=reply.name))
        got = segment_tensor(reply.fd, value.numel() * 4, "float32", [1024, 1024], shared=True)
        reply.close()
        stub.close()
        assert chunk.in_segment and torch.equal(got, value)
    finally:
        w.stop(0)


@needs_cuda
def test_a_cuda_worker_runs_ops_and_training_like_the_cpu():
    info = run_scenario("_gpu_run.py", "ops", env={"DTORCH_LOCAL_DEVICE": "cuda:0"})
    assert info["device_types"] == ["cuda"]
    for key in ("matmul", "softmax", "sum", "gather", "partial_read", "train"):
        assert info[key] < TOL, info


@needs_cuda
def test_a_cuda_and_a_cpu_worker_redistribute_to_each_other(tmp_path):
    keys = Keys.make(tmp_path)
    controller, address = start_controller(tmp_path / "addr", keys.env(keys.admin), limit=60)
    env = keys.env(keys.worker)
    procs = [controller, start_worker(address, env, "--device", "cuda:0", log=tmp_path / "w0.log"),
             start_worker(address, env, "--device", "cpu", log=tmp_path / "w1.log")]
    try:
        info = run_scenario("_gpu_run.py", "mixed", "--controller", address, env={"DTORCH_API_KEY": keys.alice})
    finally:
        stop_all(procs)
    assert info["device_types"] == ["cpu", "cuda"]
    for key in ("gather", "to_shard1", "partial", "cross_mesh"):
        assert info[key] == 0.0, info  # data movement (and a two-term sum) is exact on either device
    assert info["dropout"] == 0.0 and 0 < info["dropped"] < 60, info  # the same mask on either device type
    assert "cpu and cuda workers" in info["random"] and "one device type" in info["random"], info


@needs_cuda
@pytest.mark.parametrize("graph", [(), ("--graph",)], ids=["eager", "graph"])
def test_a_killed_cuda_worker_is_rebuilt_and_training_results_are_identical(graph):
    """Three workers on the one GPU (so no NCCL group: they share it); SIGKILL one mid-training; the step run
    eagerly, or as a graph with dtorch.optim.AdamW (its step counters on the GPU)."""
    result = run_scenario("_fault_run.py", "kill", *graph,
                 env={"DTORCH_LOCAL_DEVICE": "cuda:0", "DTORCH_SNAPSHOT_BATCHES": "4"})
    info = result["info"]
    assert info["error"] is None, info
    (clean_losses, clean_weights), (losses, weights) = result["clean"], result["run"]
    assert losses == clean_losses and weights == clean_weights
    assert info["workers"][info["victim"]] == "lost"
    assert info["graphed"] == (7 if graph else None)


@needs_cuda
@pytest.mark.parametrize("mode", ["tp", pytest.param("llama", marks=needs_transformers)])
def test_tp_and_dp_x_tp_llama_train_like_torch_on_two_workers_sharing_one_gpu(mode):
    """The two-GPU scenarios below with both workers on cuda:0 (no NCCL group: one rank per device; the pieces)."""
    info = run_scenario("_gpu_run.py", mode, env={"DTORCH_LOCAL_DEVICE": "cuda:0"})
    assert info["train"] < (TOL if mode == "tp" else 1e-3), info


@needs_two
def test_nccl_collectives_on_two_gpus_match_torch_and_move_o_of_the_size():
    info = run_scenario("_gpu_run.py", "collectives", env={"DTORCH_LOCAL_DEVICE": "cuda"})
    assert all(v == 0.0 for v in info["errors"].values()), info
    size = 4 << 20  # a 4 MiB all-reduce of 4 devices on 2 ranks: each rank's 2 halves of the other's chunk, then
    # the other's reduced chunk (1.5 x the size); the pieces' path would pull 4 x the size into each worker
    assert all(1.4 < got / size < 1.6 for got in info["received"].values()), info


@needs_two
def test_a_tp_mlp_trains_on_two_gpus_like_torch():
    assert run_scenario("_gpu_run.py", "tp", env={"DTORCH_LOCAL_DEVICE": "cuda"})["train"] < TOL


@needs_two
@needs_transformers
def test_dp_x_tp_llama_training_on_two_gpus_equals_torch():
    assert run_scenario("_gpu_run.py", "llama", env={"DTORCH_LOCAL_DEVICE": "cuda"})["train"] < 1e-3
