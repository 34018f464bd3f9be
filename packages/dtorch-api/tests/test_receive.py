"""A Pull reply as the client assembles it (`_dataplane._receive`): streamed chunks into one tensor,
a reply in the read's segment as that memory, and a reply that does not add up is an error, never a wrong tensor."""

from __future__ import annotations

import os

import pytest
import torch

from dtorch._dataplane import _receive
from dtorch.errors import DTorchError
from dtorch_protocol import messages as m
from dtorch_protocol import segments
from dtorch_protocol.values import host_bytes


def chunks(t: torch.Tensor, piece: int) -> list[m.Chunk]:
    data = bytes(host_bytes(t.contiguous()))
    parts = [data[i:i + piece] for i in range(0, len(data), piece)] or [b""]
    return [m.Chunk(data=p, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape)) if i == 0 else
            m.Chunk(data=p) for i, p in enumerate(parts)]


@pytest.mark.parametrize("value", [torch.arange(12.0).reshape(3, 4), torch.tensor(5, dtype=torch.int64),
                                   torch.ones(0, 3), torch.tensor([True, False]), torch.randn(7).bfloat16()])
@pytest.mark.parametrize("piece", [1, 5, 1 << 20])
def test_streamed_chunks_in_any_pieces_make_the_tensor(value, piece):
    got, in_segment = _receive(iter(chunks(value, piece)), None)
    assert not in_segment and got.dtype == value.dtype and torch.equal(got, value)


def test_a_reply_that_does_not_add_up_is_refused():
    c = chunks(torch.arange(6.0), 8)
    with pytest.raises(DTorchError, match="sent 16 bytes of a float32 tensor of shape \\[6\\] \\(24 bytes\\)"):
        _receive(iter(c[:2]), None)
    with pytest.raises(DTorchError, match="sent 32 bytes"):
        _receive(iter(c + [m.Chunk(data=b"12345678")]), None)
    with pytest.raises(DTorchError, match="ended before any data"):
        _receive(iter([]), None)
    with pytest.raises(DTorchError, match="missing here"):
        _receive(iter([m.Chunk(data=b"", error="missing here", kind=m.ErrorKind.MISSING)]), None)


def test_a_reply_in_the_reads_segment_is_that_memory_and_must_fit_it():
    seg = segments.for_pull("s", 1, 0, 24)
    os.pwrite(seg.fd, host_bytes(torch.arange(6.0)), segments.HEADER)  # what the worker writes
    done = m.Chunk(data=b"", dtype="float32", shape=[2, 3], in_segment=True)
    got, in_segment = _receive(iter([done]), seg)
    assert in_segment and torch.equal(got, torch.arange(6.0).reshape(2, 3))
    os.pwrite(seg.fd, host_bytes(torch.ones(1)), segments.HEADER)
    assert got[0, 0] == 1.0  # the tensor is the segment's memory, not a copy of it
    with pytest.raises(DTorchError, match="did not make for it"):
        _receive(iter([m.Chunk(data=b"", dtype="float32", shape=[7], in_segment=True)]), seg)
    with pytest.raises(DTorchError, match="did not make for it"):
        _receive(iter([done]), None)
    seg.close()
