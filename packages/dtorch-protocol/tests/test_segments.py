"""Same-host segments (segments.py): what a worker accepts, what it refuses, and that neither side can pull the
memory from under the other."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from dtorch_protocol import segments
from dtorch_protocol.segments import SegmentMissing, SegmentRefused, for_pull, for_put, open_for, write_into
from dtorch_protocol.values import host_bytes, segment_tensor

N = 3 << 20


def f32(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.float32)


def payload() -> torch.Tensor:
    return torch.arange(N // 4, dtype=torch.float32)


def test_a_puts_segment_becomes_the_workers_own_copy_on_write_and_the_client_cannot_change_it():
    value = payload()
    seg = for_put("s1", 7, 2, [host_bytes(value)])
    assert seg is not None
    got = open_for(seg.name, "s1", 7, 2, N)
    assert torch.equal(f32(got), value)
    f32(got).add_(1)  # the worker's in-place op: its own pages
    assert torch.equal(f32(open_for(seg.name, "s1", 7, 2, N)), value)
    with pytest.raises(PermissionError):  # sealed: the client can neither write nor truncate nor grow it
        os.pwrite(seg.fd, b"x", segments.HEADER)
    with pytest.raises(PermissionError):
        os.ftruncate(seg.fd, 0)
    with pytest.raises(PermissionError):
        os.ftruncate(seg.fd, 2 * N)
    seg.close()
    assert torch.equal(f32(got), value + 1)  # the mapping outlives the client's descriptor


def test_a_pulls_reply_written_by_the_worker_is_the_clients_tensor_and_the_segment_cannot_shrink():
    seg = for_pull("s1", 7, 2, N)
    assert seg is not None
    with pytest.raises(PermissionError):
        os.ftruncate(seg.fd, 0)
    write_into(seg.name, "s1", 7, 2, host_bytes(payload()))
    inode = os.fstat(seg.fd).st_ino
    got = segment_tensor(seg.fd, N, "float32", [N // 4], shared=True)
    seg.close()
    assert torch.equal(got, payload())
    assert inode not in segments.held()  # the tensor's mapping keeps no descriptor (rule 6)


@pytest.mark.parametrize("session, tid, device", [("s2", 7, 2), ("s1", 8, 2), ("s1", 7, 3)])
def test_a_segment_made_for_another_session_tensor_or_device_is_refused(session, tid, device):
    put, pull = for_put("s1", 7, 2, [host_bytes(payload())]), for_pull("s1", 7, 2, N)
    assert put is not None and pull is not None
    with pytest.raises(SegmentRefused, match="not made for"):
        open_for(put.name, session, tid, device, N)
    with pytest.raises(SegmentRefused, match="not made for"):
        write_into(pull.name, session, tid, device, host_bytes(payload()))
    assert not any(os.pread(pull.fd, N, segments.HEADER))  # nothing was written
    put.close(), pull.close()


def test_a_pull_segment_cannot_pass_for_a_put_one_the_client_could_still_write():
    seg = for_pull("s1", 7, 2, N)
    assert seg is not None
    with pytest.raises(SegmentRefused, match="sealed for a Put"):
        open_for(seg.name, "s1", 7, 2, N)
    seg.close()


@pytest.mark.parametrize("name", ["1/../etc/passwd", "1/2/3", "self/3", "", "1/" + "9" * 11, "dtorch-00"])
def test_names_not_of_the_form_pid_fd_are_refused(name):
    with pytest.raises(SegmentRefused, match="not of the form"):
        open_for(name, "s1", 7, 2, N)


def test_other_files_a_tenant_can_name_are_refused_and_nothing_hangs():
    r, w = os.pipe()  # a fifo: opening it must not block
    with tempfile.TemporaryFile() as f:
        f.write(segments._header("s1", 7, 2) + bytes(N))  # the right header, but not a sealed memory file
        f.flush()
        for fd in (r, w, f.fileno()):
            with pytest.raises(SegmentRefused, match="not a shared-memory segment"):
                write_into(f"{os.getpid()}/{fd}", "s1", 7, 2, host_bytes(payload()))
    os.close(r), os.close(w)


def test_a_segment_that_cannot_be_reached_or_does_not_fit_means_stream():
    with pytest.raises(SegmentMissing):
        open_for(f"{os.getpid()}/999999", "s1", 7, 2, N)  # no such descriptor (another host's)
    with pytest.raises(SegmentMissing):
        write_into("4000000000/3", "s1", 7, 2, host_bytes(payload()))  # no such process
    seg = for_pull("s1", 7, 2, N)
    assert seg is not None
    with pytest.raises(SegmentMissing, match="payload bytes"):
        write_into(seg.name, "s1", 7, 2, host_bytes(torch.ones(N // 4 + 1)))
    seg.close()
    with pytest.raises(SegmentMissing):
        write_into(seg.name, "s1", 7, 2, host_bytes(payload()))  # closed by the client: gone
