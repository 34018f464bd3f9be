"""Same-host shared memory for payloads: a Put's bytes, a Pull's reply, whole shards between workers (PutShards,
PullShards), without a gRPC byte stream.

Rules:

1. A segment is an anonymous memory file of the client (`memfd_create`), sealed so that nobody can shrink or grow
   it: nobody can truncate it under a worker that maps it (a tenant cannot crash a shared worker with a SIGBUS).
   Its name on the wire is `<client pid>/<fd>`; a worker on the same host opens it as `/proc/<pid>/fd/<fd>` (the
   same user, or root). The client closes its descriptor when the call ends.
2. Bytes go in with system calls (`pwrite`: no room is an error there, never a SIGBUS). A Put's segment
   (`for_put`) is written by the client and then sealed against writes too: the worker maps it copy-on-write
   (`open_for`) and keeps it as the shard itself, which the client can no longer change. A Pull's segment
   (`for_pull`) is written by the worker (`write_into`); the client's tensor is its mapping of it. A segment for
   whole shards pulled from a peer (`for_shards`: their size is known only to the peer) is sealed against
   shrinking only and holds no payload yet: the peer appends the storages (`append_into`), then the puller seals
   it against every change (`Segment.seal`) and maps it copy-on-write like a Put's (`open_for`).
3. It starts with a `HEADER`-byte header: `MAGIC`, the tid and logical device, and the SHA-256 of the session
   (for whole shards a worker sends a peer, PutShards: the namespace they go to, tid and device -1); the payload
   follows. A worker uses a segment only if it is a regular file sealed as rules 1-2 say, whose header
   names the session, tid and device of the request (whose capability the worker checked). A tenant that names
   another tenant's segment is refused (`SegmentRefused`), and a segment made for one session cannot pass for
   another's.
4. A worker that cannot open the segment (it runs on another host, in another pid namespace, as another user) or
   whose size does not fit the request raises `SegmentMissing`: the worker then streams a Pull's bytes, and
   refuses a Put with `ErrorKind.NO_SEGMENT`, after which the client streams to that worker.
5. Payloads under `MIN_BYTES` always stream: below it a segment's system calls cost more than the copies saved.
6. A tensor that lives on a segment (an upload a CPU worker keeps, a client's read) is mapped through
   `/proc/self/fd/<fd>` of a checked descriptor (`path`, for `torch.UntypedStorage.from_file`), a mapping that holds
   no descriptor: a worker keeping thousands of uploads, or a client thousands of reads, does not run out of
   them (Python's `mmap` keeps one per mapping). Whole shards (`open_for`: one mapping per PutShards or PullShards
   call, many storages) keep one per call.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import stat
import struct
from collections.abc import Sequence

try:
    import fcntl
except ImportError:  # not a POSIX system: no segments, everything streams
    fcntl = None  # type: ignore[assignment]

MIN_BYTES = 1 << 20
MAGIC = b"DTSEGv01"
_HEAD = struct.Struct("<8sqq32s")  # magic, tid, device, sha256(session)
HEADER = 64  # bytes before the payload (the payload stays 64-byte aligned)
_NAME = re.compile(r"([0-9]{1,10})/([0-9]{1,10})")
_FIXED = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0) | getattr(fcntl, "F_SEAL_SEAL", 0)
_WRITTEN = _FIXED | getattr(fcntl, "F_SEAL_WRITE", 0)
_GROWING = getattr(fcntl, "F_SEAL_SHRINK", 0)


class SegmentMissing(Exception):
    """No usable segment of that name here (another host, no access, a size that does not fit): stream."""


class SegmentRefused(ValueError):
    """A segment that exists but may not be used for this request (rule 3)."""


def _header(session: str, tid: int, device: int) -> bytes:
    return _HEAD.pack(MAGIC, tid, device, hashlib.sha256(session.encode()).digest()).ljust(HEADER, b"\0")


class Segment:
    """The maker's side of one transfer: `name` goes in the request; `path(fd)` maps it (rule 6); `close()` ends
    the call's hold (mappings made from it stay valid)."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd, self.nbytes = fd, nbytes
        self.name = f"{os.getpid()}/{fd}"

    def seal(self) -> None:
        """A `for_shards` segment, written by the peer: sealed against every change before it is mapped."""
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _WRITTEN)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _memfd() -> int | None:
    if not hasattr(os, "memfd_create") or not _WRITTEN:
        return None
    try:
        return os.memfd_create("dtorch-segment", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    except OSError:
        return None


def for_put(session: str, tid: int, device: int, parts: Sequence[memoryview]) -> Segment | None:
    """A segment holding `parts` one after another, sealed against every change (rule 2), or None where this host
    cannot make one."""
    fd = _memfd()
    if fd is None:
        return None
    try:
        os.pwrite(fd, _header(session, tid, device), 0)
        nbytes = _write_parts(fd, parts)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _WRITTEN)
    except OSError:  # no room
        os.close(fd)
        return None
    return Segment(fd, nbytes)


def for_pull(session: str, tid: int, device: int, nbytes: int) -> Segment | None:
    """A segment of `nbytes` of reply, sealed against resizing (rule 2), or None where this host cannot make one."""
    fd = _memfd()
    if fd is None:
        return None
    try:
        os.ftruncate(fd, HEADER + nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _FIXED)
        os.pwrite(fd, _header(session, tid, device), 0)
    except OSError:
        os.close(fd)
        return None
    return Segment(fd, nbytes)


def for_shards(session: str) -> Segment | None:
    """An empty segment for whole shards of `session` a peer appends (rule 2), or None where this host cannot make
    one."""
    fd = _memfd()
    if fd is None:
        return None
    try:
        os.pwrite(fd, _header(session, -1, -1), 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _GROWING)
    except OSError:
        os.close(fd)
        return None
    return Segment(fd, 0)


def append_into(name: str, session: str, parts: Sequence[memoryview]) -> None:
    """The peer's side of a PullShards: `parts` one after another into the puller's empty segment `name` (system
    calls; a full memory is SegmentMissing), after the checks of rule 3."""
    fd = _open(name, session, -1, -1, 0, _GROWING)
    try:
        _write_parts(fd, parts)
    except OSError as e:
        raise SegmentMissing(f"segment {name} could not take the shards ({e.strerror})") from None
    finally:
        os.close(fd)


def path(fd: int) -> str:
    """Where this process maps a segment's descriptor from (rule 6): `torch.UntypedStorage.from_file(path(fd),
    shared, HEADER + nbytes)`, the payload from byte HEADER on."""
    return f"/proc/self/fd/{fd}"


def held() -> set[int]:
    """The segments this process holds a descriptor of, by inode (descriptor numbers are reused, a memory file's
    inode is not): what tests check to show that nothing a transfer opened is left open (Linux: /proc)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "dtorch-segment" in os.readlink(f"/proc/self/fd/{fd}"):
                found.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return found


def opened(name: str, session: str, tid: int, device: int, nbytes: int) -> int:
    """The worker's side of a Put: a descriptor of segment `name` after the checks of rule 3 (the caller maps it
    copy-on-write, `path`, and closes it). SegmentMissing when it cannot be used here (rule 4), SegmentRefused when
    it may not."""
    return _open(name, session, tid, device, nbytes, _WRITTEN)


def open_for(name: str, session: str, tid: int, device: int, nbytes: int) -> memoryview:
    """Whole shards (PutShards, PullShards): the payload of segment `name` after the checks of rule 3, a byte view
    of a copy-on-write mapping that is this worker's own (it holds a descriptor while it lives, rule 6)."""
    fd = opened(name, session, tid, device, nbytes)
    try:
        mapping = mmap.mmap(fd, HEADER + nbytes, flags=mmap.MAP_PRIVATE)
    finally:
        os.close(fd)
    return memoryview(mapping)[HEADER:]


def write_into(name: str, session: str, tid: int, device: int, data: memoryview) -> None:
    """The worker's side of a Pull: `data` written into the client's segment `name` (system calls: a full memory
    is an error here, SegmentMissing, never a SIGBUS), after the checks of rule 3."""
    fd = _open(name, session, tid, device, len(data), _FIXED)
    try:
        _write_all(fd, data, HEADER)
    except OSError as e:
        raise SegmentMissing(f"segment {name} could not take the reply ({e.strerror})") from None
    finally:
        os.close(fd)


def _write_parts(fd: int, parts: Sequence[memoryview]) -> int:
    """`parts` one after another from the payload's start; returns their bytes."""
    at = HEADER
    for part in parts:
        _write_all(fd, part, at)
        at += len(part)
    return at - HEADER


def _write_all(fd: int, data: memoryview, at: int) -> None:
    """`data` at offset `at` of `fd` (a pwrite may write less than asked)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], at + done)


_USES = {_WRITTEN: "Put", _GROWING: "PullShards"}


def _open(name: str, session: str, tid: int, device: int, nbytes: int, seals: int) -> int:
    """A descriptor of segment `name`, checked as rule 3 says."""
    found = _NAME.fullmatch(name)
    if not found:
        raise SegmentRefused(f"segment name {name[:80]!r} is not of the form <pid>/<fd>")
    try:
        # non-blocking and no controlling terminal: naming a fifo or a tty of one's own must not hang or hijack
        fd = os.open(f"/proc/{found[1]}/fd/{found[2]}", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise SegmentMissing(f"no shared-memory segment {name} reachable from this worker ({e.strerror})") from None
    try:
        try:
            sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & seals == seals
        except OSError:
            sealed = False
        size = os.fstat(fd)
        if not stat.S_ISREG(size.st_mode) or not sealed:
            raise SegmentRefused(f"{name} is not a shared-memory segment sealed for a "
                                 f"{_USES.get(seals, 'Pull')}")
        if os.pread(fd, HEADER, 0) != _header(session, tid, device):
            raise SegmentRefused(f"segment {name} was not made for tensor {tid} on logical device {device} of this "
                                 "session")
        if size.st_size != HEADER + nbytes:
            raise SegmentMissing(f"segment {name} holds {size.st_size - HEADER} payload bytes, not the {nbytes} of "
                                 "the request")
    except BaseException:
        os.close(fd)
        raise
    return fd
