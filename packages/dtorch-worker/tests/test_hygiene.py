"""Memory hygiene: what one session frees on a worker never reaches another session through the ops that hand
out uninitialized memory (`empty_like` gave back 99-100% of another tenant's values before)."""

from __future__ import annotations

import pytest
import torch

from dtorch_protocol.messages import CmdCreate, CmdDelete, CmdRun, Execute
from dtorch_worker import hygiene
from dtorch_worker.executor import Executor
from dtorch_worker.store import TensorStore

SECRET = 1234.5


@pytest.fixture
def ex() -> Executor:
    return Executor(TensorStore())


def _leave_secrets_behind(ex: Executor, seq: int, n: int) -> int:
    """Session A fills tensors with a recognisable value and frees them."""
    for i in range(8):
        ex.run_batch(Execute(seq=seq, session="A", cmds=[
            CmdCreate(tid=i, dtype="float32", shape=[n], init="full", value=SECRET, boxes={0: [[0, n]]})]))
        seq += 1
    ex.run_batch(Execute(seq=seq, session="A", cmds=[CmdDelete(tids=list(range(8)), devices=[0])]))
    return seq + 1


def _run(ex: Executor, seq: int, op: str, args: list, kwargs: dict | None = None) -> torch.Tensor:
    ex.run_batch(Execute(seq=seq, session="B", cmds=[CmdRun(op=op, devices=[0], args=args, kwargs=kwargs or {},
                                                             outs=[100 + seq])]))
    out = ex.store.get(("B", 100 + seq, 0))
    assert isinstance(out, torch.Tensor), out
    return out


@pytest.mark.parametrize("n", [1000, 8000])
def test_empty_ops_hand_out_no_bytes_of_another_session(ex, n):
    seq = _leave_secrets_behind(ex, 1, n)
    ex.run_batch(Execute(seq=seq, session="B", cmds=[
        CmdCreate(tid=1, dtype="float32", shape=[n], init="zeros", boxes={0: [[0, n]]})]))
    outs = [
        _run(ex, seq + 1, "aten.empty_like.default", [{"$t": 1}]),
        _run(ex, seq + 2, "aten.new_empty.default", [{"$t": 1}, [n]]),
        _run(ex, seq + 3, "aten.empty.memory_format", [[n]], {"dtype": {"$dtype": "float32"}}),
        _run(ex, seq + 4, "aten.empty_strided.default", [[n // 2], [2]], {"dtype": {"$dtype": "float32"}}),
    ]
    for out in outs:
        assert not (out == SECRET).any()
        storage = torch.empty(0, dtype=torch.uint8).set_(out.untyped_storage())
        assert not storage.any(), "the gaps of a strided output are reachable with as_strided: zeroed too"


@pytest.mark.parametrize("n", [1000, 100_000])
def test_an_output_on_more_storage_than_it_fills_hands_out_no_bytes_of_another_session(ex, n):
    """`unique_consecutive` of n equal values returns 1 element on a fresh storage of n, which it never wrote: its
    other n - 1 slots held another session's freed values, and `as_strided` reaches the whole storage (99,992 of
    100,000 elements came back equal to the other tenant's before)."""
    seq = _leave_secrets_behind(ex, 1, n)
    ex.run_batch(Execute(seq=seq, session="B", cmds=[
        CmdCreate(tid=1, dtype="float32", shape=[n], init="zeros", boxes={0: [[0, n]]})]))
    ex.run_batch(Execute(seq=seq + 1, session="B", cmds=[
        CmdRun(op="aten.unique_consecutive.default", devices=[0], args=[{"$t": 1}, False, True], kwargs={},
               outs=[2, None, 3])]))
    ex.run_batch(Execute(seq=seq + 2, session="B", cmds=[
        CmdRun(op="aten.as_strided.default", devices=[0], args=[{"$t": 2}, [n], [1], 0], kwargs={}, outs=[4])]))
    unique, whole = ex.store.get(("B", 2, 0)), ex.store.get(("B", 4, 0))
    assert unique.tolist() == [0.0] and ex.store.get(("B", 3, 0)).tolist() == [n]
    assert not whole.any(), f"{int((whole == SECRET).sum())} of {n} slots hold the other session's value"


def test_views_and_dense_outputs_are_left_as_they_are(ex):
    """Only storages an op allocated and did not fill are touched: a view of an input keeps its storage's values."""
    ex.run_batch(Execute(seq=1, session="B", cmds=[
        CmdCreate(tid=1, dtype="float32", shape=[8], init="arange", arange=[1, 9, 1], boxes={0: [[0, 8]]})]))
    narrow = _run(ex, 2, "aten.slice.Tensor", [{"$t": 1}, 0, 2, 4])
    every_other = _run(ex, 3, "aten.as_strided.default", [{"$t": 1}, [4], [2], 0])
    assert narrow.tolist() == [3, 4] and every_other.tolist() == [1, 3, 5, 7]
    assert ex.store.get(("B", 1, 0)).tolist() == list(range(1, 9))


def test_a_growing_resize_zeroes_the_new_bytes_only(ex):
    seq = _leave_secrets_behind(ex, 1, 4000)
    ex.run_batch(Execute(seq=seq, session="B", cmds=[
        CmdCreate(tid=1, dtype="float32", shape=[4], init="arange", arange=[1, 5, 1], boxes={0: [[0, 4]]})]))
    ex.run_batch(Execute(seq=seq + 1, session="B", cmds=[
        CmdRun(op="aten.resize_.default", devices=[0], args=[{"$t": 1}, [4000]], kwargs={}, outs=[1])]))
    grown = ex.store.get(("B", 1, 0))
    assert grown[:4].tolist() == [1, 2, 3, 4] and not grown[4:].any()


def test_the_tables_name_only_ops_that_exist():
    from dtorch_worker.ops import resolve_op

    for name in hygiene.UNINITIALIZED | hygiene.GROWING:
        resolve_op(name)
