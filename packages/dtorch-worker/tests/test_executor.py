"""Executor unit tests: commands run directly against a store, no gRPC."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from dtorch_protocol.messages import (
    CmdCloseSession,
    CmdCreate,
    CmdDelete,
    CmdExpectReads,
    CmdProgram,
    CmdRedistribute,
    CmdReplay,
    CmdRun,
    CmdSendShards,
    ErrorReport,
    Execute,
    Piece,
    ShardPlan,
)
from dtorch_protocol.placement_types import Replicate, Shard
from dtorch_worker import executor as executor_module
from dtorch_worker import random_blocks
from dtorch_worker.executor import Executor
from dtorch_worker.store import Poison, TensorStore

S = "session-1"


@pytest.fixture
def ex() -> Executor:
    executor = Executor(TensorStore(), input_timeout_s=0.05)
    yield executor
    executor.stop()


def run(ex: Executor, *cmds: object) -> None:
    ex.run_batch(Execute(seq=0, session=S, cmds=list(cmds)))  # type: ignore[arg-type]


def t(tid: int) -> dict[str, int]:
    return {"$t": tid}


# ---------------------------------------------------------------- create


@pytest.mark.parametrize("init,kw,ref", [
    ("zeros", {}, lambda s: torch.zeros(s)),
    ("empty", {}, lambda s: torch.zeros(s)),
    ("ones", {}, lambda s: torch.ones(s)),
    ("full", {"value": 2.5}, lambda s: torch.full(s, 2.5)),
])
def test_create_deterministic_uneven_and_empty_boxes(ex: Executor, init: str, kw: dict, ref: object,
                                                     h: SimpleNamespace) -> None:
    shape = [2, 5]
    boxes = h.boxes_for(shape, [4], [Shard(0)])  # torch.chunk: devices 2 and 3 get empty boxes
    assert boxes[2] == [[2, 0], [0, 5]] and boxes[3] == [[2, 0], [0, 5]]
    run(ex, CmdCreate(tid=1, dtype="float32", shape=shape, init=init, boxes=boxes, **kw))
    shards = h.shards_of(ex.store, S, 1, range(4))
    assert shards[2].shape == (0, 5) and shards[3].shape == (0, 5)
    assert torch.equal(h.assemble(shards, boxes, shape, torch.float32), ref(shape))  # type: ignore[operator]


def test_create_arange_uneven(ex: Executor, h: SimpleNamespace) -> None:
    boxes = h.boxes_for([10], [3], [Shard(0)])  # 4, 4, 2
    run(ex, CmdCreate(tid=1, dtype="int64", shape=[10], init="arange", boxes=boxes, arange=[3, 23, 2]))
    shards = h.shards_of(ex.store, S, 1, range(3))
    assert [len(s) for s in shards.values()] == [4, 4, 2]
    assert torch.equal(h.assemble(shards, boxes, [10], torch.int64), torch.arange(3, 23, 2))


@pytest.mark.parametrize("init,dtype", [("rand", torch.float32), ("randn", torch.float64), ("randn", torch.bfloat16)])
def test_random_create_is_independent_of_the_layout(ex: Executor, init: str, dtype: torch.dtype,
                                                    h: SimpleNamespace) -> None:
    shape, seed = [7, 6], 1234
    name = str(dtype).removeprefix("torch.")
    layout_a = h.boxes_for(shape, [3], [Shard(0)])
    layout_b = h.boxes_for(shape, [2, 2], [Shard(1), Shard(0)], devices=[10, 11, 12, 13])
    run(ex, CmdCreate(tid=1, dtype=name, shape=shape, init=init, boxes=layout_a, seed=seed),
        CmdCreate(tid=2, dtype=name, shape=shape, init=init, boxes=layout_b, seed=seed))
    a = h.assemble(h.shards_of(ex.store, S, 1, layout_a), layout_a, shape, dtype)
    b = h.assemble(h.shards_of(ex.store, S, 2, layout_b), layout_b, shape, dtype)
    expected = random_blocks.draw(init, seed, shape, [[0, 7], [0, 6]], dtype)
    assert torch.equal(a, expected) and torch.equal(b, expected)
    assert not torch.equal(expected, random_blocks.draw(init, seed + 1, shape, [[0, 7], [0, 6]], dtype))


def test_random_create_draws_only_the_shard(ex: Executor) -> None:
    """A 2**40-element tensor (4 TiB): drawing it whole would fail; a device draws its 6 elements."""
    shape, box = [1 << 20, 1 << 20], [[(1 << 20) - 2, 2], [5, 3]]
    run(ex, CmdCreate(tid=1, dtype="float32", shape=shape, init="randn", boxes={0: box}, seed=3))
    shard = ex.store.get((S, 1, 0))
    assert shard.shape == (2, 3) and torch.equal(shard, random_blocks.draw("randn", 3, shape, box, torch.float32))
    assert ex.take_errors() == {}


def test_block_values_cross_block_edges_and_look_uniform_and_normal() -> None:
    shape = [600, 300]  # blocks of 256 x 256: boxes below cross their edges
    whole = random_blocks.draw("randn", 1, shape, [[0, 600], [0, 300]], torch.float32)
    for box in ([[250, 20], [0, 300]], [[0, 600], [255, 2]], [[511, 89], [290, 10]]):
        part = random_blocks.draw("randn", 1, shape, box, torch.float32)
        assert torch.equal(part, whole[box[0][0]:sum(box[0]), box[1][0]:sum(box[1])])
    assert abs(whole.mean()) < 0.02 and abs(whole.std() - 1) < 0.02 and whole.unique().numel() > 0.99 * whole.numel()
    assert not torch.equal(whole[:256, :256], whole[256:512, :256])  # each block its own seed
    u = random_blocks.draw("rand", 1, [200000], [[0, 200000]], torch.float64)  # 1-d: blocks of 65536
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    assert torch.equal(u[65530:65540], random_blocks.draw("rand", 1, [200000], [[65530, 10]], torch.float64))
    assert random_blocks.block_shape([4096, 4096]) == [256, 256] and random_blocks.block_shape([9, 1, 1]) == [9, 1, 1]
    assert random_blocks.block_shape([64, 512, 1024]) == [1, 256, 256]


def test_replicated_create_does_not_share_storage_and_partial_zeros(ex: Executor, h: SimpleNamespace) -> None:
    boxes = h.boxes_for([3], [3], [Replicate()])
    run(ex, CmdCreate(tid=1, dtype="float32", shape=[3], init="rand", boxes=boxes, seed=5, zero=[2]))
    s = h.shards_of(ex.store, S, 1, range(3))
    assert torch.equal(s[0], s[1]) and torch.equal(s[2], torch.zeros(3))
    run(ex, CmdRun(op="aten.add_.Tensor", devices=[0], args=[t(1), 1.0], kwargs={}, outs=[1]))
    assert not torch.equal(s[0], s[1])  # in place on device 0 only


# ---------------------------------------------------------------- run


def test_run_with_local_overrides_views_and_in_place(ex: Executor, h: SimpleNamespace) -> None:
    boxes = h.boxes_for([4, 3], [2], [Shard(0)])
    run(ex, CmdCreate(tid=1, dtype="float32", shape=[4, 3], init="arange", boxes=boxes, arange=[0, 12, 1]),
        # device 1 gets a per-device argument: its local view size
        CmdRun(op="aten.view.default", devices=[0, 1], args=[t(1), [6]], kwargs={}, outs=[2],
               local={1: [[t(1), [3, 2]], {}]}),
        CmdRun(op="aten.mul.Tensor", devices=[0, 1], args=[t(1), 2], kwargs={}, outs=[3], local={1: [[t(1), 3], {}]}))
    s2 = h.shards_of(ex.store, S, 2, [0, 1])
    assert s2[0].shape == (6,) and s2[1].shape == (3, 2)
    assert s2[0]._base is ex.store.get((S, 1, 0))  # a view of the input, stored as such
    s3 = h.shards_of(ex.store, S, 3, [0, 1])
    assert torch.equal(s3[0], torch.arange(6.0).view(2, 3) * 2)
    assert torch.equal(s3[1], torch.arange(6.0, 12.0).view(2, 3) * 3)
    run(ex, CmdRun(op="aten.add_.Tensor", devices=[0, 1], args=[t(1), 100], kwargs={}, outs=[None]))
    assert s2[0][0] == 100.0  # the view sees the in-place update: intended semantics


def test_run_multiple_outputs_kwargs_and_literals(ex: Executor) -> None:
    x = torch.tensor([[1.0, 5.0, 2.0], [7.0, 0.0, 3.0]])
    lit = {"$lit": ["float32", [2, 3], x.numpy().tobytes()]}
    run(ex, CmdRun(op="aten.clone.default", devices=[0], args=[lit], kwargs={}, outs=[1]),
        CmdRun(op="aten.max.dim", devices=[0], args=[t(1), 1], kwargs={"keepdim": True}, outs=[2, None]),
        CmdRun(op="aten.split.Tensor", devices=[0], args=[t(1), 1, 1], kwargs={}, outs=[None, 3, 4]),
        CmdRun(op="aten.sum.dim_IntList", devices=[0], args=[t(1), [0]], kwargs={"dtype": {"$dtype": "float64"}},
               outs=[5]))
    st = ex.store
    assert torch.equal(st.get((S, 2, 0)), torch.tensor([[5.0], [7.0]]))
    assert torch.equal(st.get((S, 3, 0)), x[:, 1:2]) and torch.equal(st.get((S, 4, 0)), x[:, 2:3])
    assert st.get((S, 5, 0)).dtype == torch.float64
    assert ex.take_errors() == {}


def test_run_under_a_seed_is_identical_per_device_and_restores_the_rng(ex: Executor) -> None:
    state = torch.get_rng_state()
    run(ex, CmdRun(op="aten.rand.default", devices=[0, 1], args=[[4]], kwargs={}, outs=[1], seed=9))
    a, b = ex.store.get((S, 1, 0)), ex.store.get((S, 1, 1))
    assert torch.equal(a, b) and torch.equal(a, torch.rand(4, generator=torch.Generator().manual_seed(9)))
    assert torch.equal(torch.get_rng_state(), state)


# ---------------------------------------------------------------- errors


def test_failure_poisons_outputs_and_reports_once(ex: Executor) -> None:
    boxes = {0: [[0, 2], [0, 3]], 1: [[0, 2], [0, 3]]}
    run(ex, CmdCreate(tid=1, dtype="float32", shape=[2, 3], init="ones", boxes=boxes),
        CmdRun(op="aten.mm.default", devices=[0, 1], args=[t(1), t(1)], kwargs={}, outs=[2], src="train.py:12"),
        CmdRun(op="aten.relu.default", devices=[0, 1], args=[t(2)], kwargs={}, outs=[3], src="train.py:13"),
        CmdRedistribute(src=3, dst=4, dtype="float32", src_line="train.py:14",
                        plans={0: ShardPlan(shape=[2, 3], groups=[[Piece("", 1, [0, 0], [0, 0], [2, 3])]])}))
    errors = ex.take_errors()
    assert list(errors) == [S] and len(errors[S]) == 1
    report = errors[S][0]
    assert report.op == "aten.mm.default" and report.src == "train.py:12" and report.tid == 2
    assert report.message.startswith("RuntimeError: ") and "\n" not in report.message
    for tid in (2, 3):
        for dev in (0, 1):
            assert ex.store.get((S, tid, dev)) == Poison(report)  # the ORIGINAL report
    assert ex.store.get((S, 4, 0)) == Poison(report)
    assert ex.take_errors() == {}


@pytest.mark.parametrize("cmd,op,message", [
    (CmdRun(op="os.system", devices=[0], args=["true"], kwargs={}, outs=[7], src="a.py:1"), "os.system",
     "UnknownOp: unknown op 'os.system': workers run only registered torch ops"),
    (CmdRun(op="aten.neg.default", devices=[0], args=[t(99)], kwargs={}, outs=[7], src="a.py:1"), "aten.neg.default",
     "ShardMissing: no shard for tensor 99 on logical device 0"),
    (CmdCreate(tid=7, dtype="int32", shape=[2], init="rand", boxes={0: [[0, 2]]}, src="a.py:1"), "create",
     "NotImplementedError: "),
    (CmdCreate(tid=7, dtype="float32", shape=[2], init="zeros", boxes={0: [[1, 2]]}, src="a.py:1"), "create",
     "ValueError: box [[1, 2]] is outside shape [2]"),
    (CmdRedistribute(src=99, dst=7, dtype="float32", src_line="a.py:1",
                     plans={0: ShardPlan(shape=[1], groups=[[Piece("", 0, [0], [0], [1])]])}), "redistribute",
     "ShardMissing: no shard for tensor 99"),
])
def test_error_reports(ex: Executor, cmd: object, op: str, message: str) -> None:
    run(ex, cmd)
    (report,) = ex.take_errors()[S]
    assert (report.op, report.src, report.tid) == (op, "a.py:1", 7)
    assert report.message.startswith(message), report.message
    assert isinstance(ex.store.get((S, 7, 0)), Poison)


def test_a_device_error_says_the_worker_stays_unusable(ex: Executor, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA device-side assert (raised as torch.AcceleratorError) leaves the process's device context unusable:
    its report says so, and how to find the op that caused it. Any other error reports only itself."""
    def kernel(name: str, op: object, device: object) -> object:
        def run(*args: object, **kwargs: object) -> object:
            if name == "aten.neg.default":
                raise torch.AcceleratorError("CUDA error: device-side assert triggered")
            raise RuntimeError("an ordinary failure")
        return run

    monkeypatch.setattr(executor_module, "kernel", kernel)
    run(ex, CmdCreate(tid=1, dtype="float32", shape=[2], init="ones", boxes={0: [[0, 2]]}),
        CmdRun(op="aten.neg.default", devices=[0], args=[t(1)], kwargs={}, outs=[2], src="a.py:1"),
        CmdRun(op="aten.abs.default", devices=[0], args=[t(1)], kwargs={}, outs=[3], src="a.py:2"))
    device_error, ordinary = ex.take_errors()[S]
    assert device_error.message.startswith("AcceleratorError: CUDA error: device-side assert triggered (a device "
                                           "error leaves this worker's device unusable: every later op on it fails")
    assert "CUDA_LAUNCH_BLOCKING=1" in device_error.message
    assert ordinary.message == "RuntimeError: an ordinary failure"


def test_a_kept_program_replays_with_new_ids_seeds_and_numbers_like_torch(ex: Executor) -> None:
    boxes = {0: [[0, 4]], 1: [[4, 4]]}
    program = CmdProgram(program=3, version=5, ntids=3, nseeds=1, nscalars=1, cmds=[
        CmdCreate(tid=1, dtype="float32", shape=[8], init="randn", boxes=boxes, seed=0),
        CmdRun(op="aten.add.Tensor", devices=[0, 1], args=[t(0), t(1)], kwargs={"alpha": {"$s": 0}}, outs=[2]),
        CmdDelete(tids=[1], devices=[0, 1])])
    run(ex, CmdCreate(tid=10, dtype="float32", shape=[8], init="ones", boxes=boxes), program)
    assert (S, 1, 0) not in ex.store  # kept, not run
    for n, (seed, alpha) in enumerate([(7, 0.5), (8, -2.0)]):
        run(ex, CmdReplay(program=3, version=5, tids=[10, 20 + n, 30 + n], seeds=[seed], scalars=[alpha]))
        r = random_blocks.draw("randn", seed, [8], [[0, 8]], torch.float32)
        got = torch.cat([ex.store.get((S, 30 + n, d)) for d in (0, 1)])
        assert torch.equal(got, torch.ones(8) + alpha * r)  # plain torch on the full tensors
        assert (S, 20 + n, 0) not in ex.store  # the program's delete ran too
    assert ex.take_errors() == {}
    run(ex, CmdReplay(program=3, version=4, tids=[10, 40, 41], seeds=[1], scalars=[1.0]),
        CmdReplay(program=3, version=5, tids=[10, 40], seeds=[1], scalars=[1.0]),
        CmdReplay(program=9, version=5, tids=[], seeds=[], scalars=[]))
    assert [e.message for e in ex.take_errors()[S]] == [
        "translation 4 of program 3 is not on this worker (it has 5)",
        "replay of program 3 names 2 tensors, 1 seeds and 1 numbers; its commands take 3, 1 and 1",
        "translation 5 of program 9 is not on this worker (it has none)"]
    run(ex, CmdCloseSession(), CmdReplay(program=3, version=5, tids=[10, 40, 41], seeds=[1], scalars=[1.0]))
    assert "has none" in ex.take_errors()[S][0].message


def test_an_upload_backup_is_copied_off_the_stream_and_in_place_writes_wait_for_it(ex: Executor, monkeypatch) -> None:
    started, release = threading.Event(), threading.Event()
    copy = ex._copy

    def held(*args: object) -> None:
        started.set()
        release.wait(10)
        copy(*args)

    monkeypatch.setattr(ex, "_copy", held)
    run(ex, CmdCreate(tid=1, dtype="float32", shape=[4], init="ones", boxes={0: [[0, 4]]}),
        CmdSendShards(devices={0: [1]}, namespace="backup", host=True, background=True),
        CmdRun(op="aten.neg.default", devices=[0], args=[t(1)], kwargs={}, outs=[2]))
    assert started.wait(10)  # the batch ran on while its copy is held
    assert torch.equal(ex.store.get((S, 2, 0)), -torch.ones(4)) and ("backup", 1, 0) not in ex.store
    assert ex.completed < 0  # the batch is not complete while its copy is in flight
    writer = threading.Thread(target=run, args=(ex, CmdRun(op="aten.add_.Scalar", devices=[0], args=[t(1), 1.0],
                                                           kwargs={}, outs=[1])))
    writer.start()
    writer.join(0.3)
    assert writer.is_alive()  # an in-place write of the shard waits for the copy to have read it
    release.set()
    writer.join(10)
    assert torch.equal(ex.store.get(("backup", 1, 0)), torch.ones(4))  # the value at the copy's place
    assert torch.equal(ex.store.get((S, 1, 0)), torch.full((4,), 2.0))
    assert ex.completed == 0 and ex.backup_bytes == 0 and ex.take_errors() == {}


def test_restore_errors_keeps_order(ex: Executor) -> None:
    r1, r2 = ErrorReport(op="a", src="", message="1"), ErrorReport(op="b", src="", message="2")
    ex._record(S, r2)
    ex.restore_errors({S: [r1]})
    assert ex.take_errors() == {S: [r1, r2]}


# ---------------------------------------------------------------- redistribute (local pieces only)


@pytest.mark.parametrize("reduce,combine", [
    ("sum", lambda a, b: a + b), ("avg", lambda a, b: (a + b) / 2),
    ("max", torch.maximum), ("min", torch.minimum),
])
def test_local_partial_to_replicate(ex: Executor, reduce: str, combine: object, h: SimpleNamespace) -> None:
    boxes = h.boxes_for([3, 2], [2], [Replicate()])
    run(ex, CmdCreate(tid=1, dtype="float32", shape=[3, 2], init="randn", boxes={0: boxes[0]}, seed=1),
        CmdCreate(tid=1, dtype="float32", shape=[3, 2], init="randn", boxes={1: boxes[1]}, seed=2))
    a, b = ex.store.get((S, 1, 0)).clone(), ex.store.get((S, 1, 1)).clone()
    whole = [0, 0], [0, 0], [3, 2]
    plan = ShardPlan(shape=[3, 2], groups=[[Piece("", 0, *whole)], [Piece("", 1, *whole)]], reduce=reduce)
    run(ex, CmdRedistribute(src=1, dst=2, dtype="float32", plans={0: plan, 1: plan}))
    expected = combine(a, b)  # type: ignore[operator]
    assert torch.equal(ex.store.get((S, 2, 0)), expected) and torch.equal(ex.store.get((S, 2, 1)), expected)
    assert ex.store.get((S, 2, 0)).data_ptr() != ex.store.get((S, 2, 1)).data_ptr()


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
@pytest.mark.parametrize("reduce,reference", [
    ("sum", lambda s: s.sum(0)), ("max", lambda s: s.amax(0)), ("min", lambda s: s.amin(0)),
    ("avg", lambda s: s.mean(0) if s.is_floating_point() else torch.div(s.sum(0), len(s), rounding_mode="trunc")),
])
def test_groups_of_signed_shares_reduce_like_torch(ex: Executor, reduce: str, reference: object,
                                                   dtype: torch.dtype) -> None:
    """Three groups (one per share) of signed values: each reduce op gives torch's reduction of the stacked shares,
    which sets every op apart from the others (sum, avg, max and min of these shares all differ)."""
    shares = torch.tensor([[[5, -7]], [[-3, 2]], [[-6, 9]]], dtype=dtype)  # 3 shares of a [1, 2] tensor
    for dev, share in enumerate(shares):
        ex.store.put((S, 1, dev), share.clone())
    whole = [0, 0], [0, 0], [1, 2]
    plan = ShardPlan(shape=[1, 2], groups=[[Piece("", dev, *whole)] for dev in range(3)], reduce=reduce)
    run(ex, CmdRedistribute(src=1, dst=2, dtype=str(dtype).removeprefix("torch."), plans={0: plan}))
    got, want = ex.store.get((S, 2, 0)), reference(shares)  # type: ignore[operator]
    assert got.dtype == dtype and torch.equal(got, want), (got, want)
    assert all(torch.equal(ex.store.get((S, 1, dev)), share) for dev, share in enumerate(shares))  # sources kept


def test_local_shard_to_shard_and_empty_plan(ex: Executor, h: SimpleNamespace) -> None:
    shape = [5, 4]
    src_boxes = h.boxes_for(shape, [2], [Shard(0)])  # rows 0-2, 3-4
    run(ex, CmdCreate(tid=1, dtype="float32", shape=shape, init="arange", boxes=src_boxes, arange=[0, 20, 1]))
    # Shard(0) -> Shard(1): device 0 takes columns 0-1 of every row, device 1 columns 2-3
    plans = {d: ShardPlan(shape=[5, 2], groups=[[Piece("", 0, [0, 2 * d], [0, 0], [3, 2]),
                                                 Piece("", 1, [0, 2 * d], [3, 0], [2, 2])]]) for d in (0, 1)}
    plans[2] = ShardPlan(shape=[5, 0], groups=[])  # a zero plan: zeros of that shape
    run(ex, CmdRedistribute(src=1, dst=2, dtype="float32", plans=plans))
    full = torch.arange(20.0).view(5, 4)
    assert torch.equal(ex.store.get((S, 2, 0)), full[:, :2]) and torch.equal(ex.store.get((S, 2, 1)), full[:, 2:])
    assert ex.store.get((S, 2, 2)).shape == (5, 0)


# ---------------------------------------------------------------- ordering, delete, close


def test_batches_run_in_seq_order_whatever_the_arrival_order() -> None:
    done: list[int] = []
    ex = Executor(TensorStore(), on_complete=done.append).start()
    try:
        b1 = Execute(seq=1, session=S, cmds=[CmdCreate(tid=1, dtype="float32", shape=[2], init="ones",
                                                       boxes={0: [[0, 2]]})])
        b2 = Execute(seq=2, session=S, cmds=[CmdRun(op="aten.add_.Tensor", devices=[0], args=[t(1), 1.0],
                                                    kwargs={}, outs=[None])])
        b3 = Execute(seq=3, session=S, cmds=[CmdRun(op="aten.mul.Tensor", devices=[0], args=[t(1), 10.0],
                                                    kwargs={}, outs=[2])])
        arrivals = [threading.Timer(0.0, ex.submit, args=(b3,)), threading.Timer(0.05, ex.submit, args=(b2,))]
        for timer in arrivals:
            timer.start()
        for timer in arrivals:
            timer.join()
        assert ex.completed == 0 and not ex.wait_completed(1, 0.05)  # 2 and 3 wait for 1
        assert ex.submit(b1)
        assert ex.wait_completed(3, 10.0)
        assert done == [1, 2, 3] and ex.completed == 3
        assert torch.equal(ex.store.get((S, 2, 0)), torch.full((2,), 20.0))
        assert not ex.submit(b2)  # a retried batch is not run twice
    finally:
        ex.stop()


def test_a_completion_is_told_at_once_unless_a_later_batch_of_its_session_is_here() -> None:
    """The agent reports a completion at once only where a sync may wait for it: a batch followed here by a later
    one of its session (which the client's sync covers too) is told as deferred (the agent reports it within its
    lag), the last one of a session at once; each completion is told once."""
    told: list[tuple[str, int]] = []
    ex = Executor(TensorStore())
    ex.on_complete = lambda seq: told.append(("now", seq))
    ex.on_deferred = lambda seq: told.append(("later", seq))

    def batch(seq: int, session: str) -> Execute:
        return Execute(seq=seq, session=session, cmds=[CmdCreate(tid=seq, dtype="float32", shape=[2], init="ones",
                                                                 boxes={0: [[0, 2]]})])

    for b in (batch(1, "s"), batch(2, "s"), batch(3, "t"), batch(4, "s")):
        assert ex.submit(b)
    ex.start()
    try:
        assert ex.wait_completed(4, 10.0)
        # 1 and 2: a later batch of s is queued here (2, then 4); 3: the last of t; 4: the last of s
        assert told == [("later", 1), ("later", 2), ("now", 3), ("now", 4)]
    finally:
        ex.stop()


def test_delete_and_close_session(ex: Executor) -> None:
    run(ex, CmdCreate(tid=1, dtype="float32", shape=[2], init="zeros", boxes={0: [[0, 1]], 1: [[1, 1]]}),
        CmdCreate(tid=2, dtype="float32", shape=[2], init="zeros", boxes={0: [[0, 2]]}),
        CmdDelete(tids=[1], devices=[0]))
    assert sorted(ex.store.keys()) == [(S, 1, 1), (S, 2, 0)]
    ex.store.put(("other", 1, 0), torch.zeros(1))
    run(ex, CmdCloseSession())
    assert ex.store.keys() == [("other", 1, 0)]


# ---------------------------------------------------------------- in-place writes and peers' planned reads


def _in_thread(fn: object, *args: object) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args)  # type: ignore[arg-type]
    thread.start()
    return thread


def test_in_place_writes_wait_for_announced_reads_of_their_storage(watched: TensorStore) -> None:
    ex = Executor(watched, input_timeout_s=0.05)
    try:
        run(ex, CmdCreate(tid=1, dtype="float32", shape=[4], init="zeros", boxes={0: [[0, 4]]}),
            CmdRun(op="aten.view.default", devices=[0], args=[t(1), [2, 2]], kwargs={}, outs=[2]),
            CmdExpectReads(tid=1, reads={0: 1}))
        run(ex, CmdRun(op="aten.neg.default", devices=[0], args=[t(1)], kwargs={}, outs=[3]))  # reads only
        assert not watched.writer_waits.is_set() and watched.pending_reads((S, 1, 0)) == 1  # ran, read unserved
        writer = _in_thread(run, ex, CmdRun(op="aten.add_.Tensor", devices=[0], args=[t(2), 1.0], kwargs={},
                                            outs=[2]))  # writes tensor 1's storage through a view
        assert watched.writer_waits.wait(30)
        assert torch.equal(watched.get((S, 1, 0)), torch.zeros(4))  # what the peer's read gets: not yet written
        watched.read_served((S, 1, 0))
        writer.join(30)
        assert not writer.is_alive() and torch.equal(watched.get((S, 1, 0)), torch.ones(4))
    finally:
        ex.stop()


@pytest.mark.parametrize("op,args,kwargs", [
    ("aten.copy_.default", [t(1), t(9)], {}),
    ("aten.add.out", [t(9), t(9)], {"out": t(1)}),
    ("aten._foreach_add_.Scalar", [[t(9), t(1)], 2.0], {}),
])
def test_every_kind_of_written_argument_waits(watched: TensorStore, op: str, args: list, kwargs: dict) -> None:
    ex = Executor(watched, input_timeout_s=0.05)
    try:
        run(ex, CmdCreate(tid=1, dtype="float32", shape=[3], init="zeros", boxes={0: [[0, 3]]}),
            CmdCreate(tid=9, dtype="float32", shape=[3], init="ones", boxes={0: [[0, 3]]}),
            CmdExpectReads(tid=1, reads={0: 1}))
        writer = _in_thread(run, ex, CmdRun(op=op, devices=[0], args=args, kwargs=kwargs, outs=[None]))
        assert watched.writer_waits.wait(30)
        assert torch.equal(watched.get((S, 1, 0)), torch.zeros(3))
        watched.read_served((S, 1, 0))
        writer.join(30)
        assert not writer.is_alive() and not torch.equal(watched.get((S, 1, 0)), torch.zeros(3))
    finally:
        ex.stop()


def test_a_read_that_never_comes_delays_the_write_only_up_to_the_timeout(watched: TensorStore,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    ex = Executor(watched, reads_timeout_s=0.2)
    try:
        run(ex, CmdCreate(tid=1, dtype="float32", shape=[2], init="zeros", boxes={0: [[0, 2]]}),
            CmdExpectReads(tid=1, reads={0: 2}))
        with caplog.at_level(logging.WARNING, logger="dtorch_worker.executor"):
            run(ex, CmdRun(op="aten.add_.Tensor", devices=[0], args=[t(1), 1.0], kwargs={}, outs=[1]))
        assert watched.writer_waits.is_set()  # it waited, and went ahead when the time was up
        assert torch.equal(watched.get((S, 1, 0)), torch.ones(2))
        assert "2 planned reads of tensor 1 on logical device 0" in caplog.text
        assert watched.pending_reads((S, 1, 0)) == 0  # given up on: forgotten
        watched.writer_waits.clear()
        run(ex, CmdRun(op="aten.add_.Tensor", devices=[0], args=[t(1), 1.0], kwargs={}, outs=[1]))
        assert not watched.writer_waits.is_set()  # the next write does not wait again
        assert torch.equal(watched.get((S, 1, 0)), torch.full((2,), 2.0))
    finally:
        ex.stop()


def test_written_args_include_a_batch_norms_running_statistics():
    """native_batch_norm's schema leaves running_mean and running_var unmarked, yet it writes them (training): the
    worker orders that write after the reads in flight, as for any in-place op (dtorch_protocol.writes)."""
    assert executor_module.written_args(torch.ops.aten.native_batch_norm.default) == ((3, "running_mean"),
                                                                                      (4, "running_var"))
    assert executor_module.written_args(torch.ops.aten.add_.Tensor) == ((0, "self"),)


def test_an_undefined_output_keeps_its_place():
    """convolution_backward without the input's gradient returns (None, grad_weight, grad_bias): the client numbers
    three outputs, the first one unused."""
    t = torch.ones(1)
    assert executor_module.flatten((None, t, [t, t])) == [None, t, t, t]
    assert executor_module.flatten(None) == [] and executor_module.flatten(t) == [t]
