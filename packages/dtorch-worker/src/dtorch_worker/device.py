"""The worker's one door to the hardware: device type, memory, comm backend, host copies and RNG.

Rules:

1. Every worker module that touches a device asks the backend of its device (`backend_for(device)`); nothing
   else in the worker names `cuda` or calls into `torch.cuda`.
2. Host copies go through host buffers the backend hands out: plain memory on the CPU, page-locked (pinned) on
   CUDA, so a device <-> host copy is one DMA and never goes through numpy. `host_bytes` (the protocol's, shared
   with the client) is a zero-copy byte view of a host tensor for the wire. Pinned only up to PINNED_MAX (256
   MiB): torch's caching host allocator rounds each pinned block up to a power of two and keeps it pinned for
   reuse, so a Pull of a 33 GiB shard would lock 64 GiB of the host's memory for good; a larger copy goes
   through pageable memory, staged by the driver.
3. Random values of factories never depend on the device: each box is drawn on the CPU by `random_blocks` (the
   blocks it overlaps: O(shard)) and copied over. Random ops (dropout) run under `seeded(seed)` on the device's
   own generator, so every device of one type draws the same values; two device types draw different ones (a
   mesh mixing them is refused for random ops by the controller's translation, see docs/architecture.md).
4. The comm backend (`comm`: "gloo", "nccl"), how a lane waits for a collective (`completion`), whether all
   groups share one lane (`one_lane`) and the construction of a process group object belong to the backend:
   `new_group` builds one group of its own (never the global default group: one worker serves many sessions),
   and so does the choice among equivalent primitives (`gather_by_all_to_all`: gloo's all_gather is several
   times slower than its all_to_all; NCCL's is its best).
5. `start` tunes the process for the device once, at worker start. On the CPU, buffers below MAPPED_FROM (32
   MiB, glibc's ceiling for it) come from one heap that keeps freed memory for reuse (one arena, up to 1 GiB kept
   at its top) instead of mapping them fresh each time: every fresh 4 KiB page costs a fault and zeroing, as much
   as moving it. Larger ones are mapped fresh and unmapped when freed: kept in the heap too (until 2026-12-05),
   each one that no freed hole fit (small buffers split the holes) grew the heap by its size, so a run of 256 MiB
   all-reduces grew a worker by 256 MiB of never-touched pages an op (2-3 s an op instead of 0.2 on a VM where
   such a page costs ~30 us), and 64 MiB ones grew it to 1.2 GB. The large buffers the worker makes itself
   (`fresh`: collectives' outputs and scratch) ask for transparent huge pages before their first touch (where
   the kernel's transparent_hugepage allows madvise): one fault per 2 MiB instead of 512. Not every buffer does:
   torch's own switch (THP_MEM_ALLOC_ENABLE) aligns every buffer from 2 MiB up to 2 MiB, which splits the heap's
   holes, and a training step's fresh 2 MiB gradients faulted in 2 MiB pages (3-5 ms more a step of
   bench_vs_torch (c)). The cost: a CPU worker's memory stays near its peak of small buffers.

Plugging in another vendor's device (xpu, npu, a PrivateUse1 backend such as `torch.utils.
rename_privateuse1_backend("npu")`): subclass `DeviceBackend` (usually `AcceleratorBackend` with a module
holding `synchronize`, `set_device`, `device_count` and `get_device_properties`, and the vendor's collective
library as `comm`, e.g. "xccl" or "hccl"), then `register("npu", NpuBackend)` before the worker starts (a
`dtorch_worker.backends` entry point or a site customization). Nothing else in the worker changes:
`--device npu:0` then works, shards live on the device, and redistributions use the vendor's collectives.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from dtorch_protocol.values import host_bytes

log = logging.getLogger(__name__)

_Factory = Callable[[torch.device], "DeviceBackend"]
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc mallopt parameters
_MADV_HUGEPAGE, _HUGE_PAGE = 14, 2 << 20
PINNED_MAX = 256 << 20  # an accelerator's host buffers are pinned up to this size, pageable above it (rule 2)
MAPPED_FROM = 32 << 20  # CPU buffers from this size up are mapped fresh, smaller ones reused from the heap (rule 5)
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: nothing to tune
    _LIBC = None
_REGISTRY: dict[str, _Factory] = {}


class DeviceBackend:
    """The CPU: host memory is device memory, gloo moves it."""

    type = "cpu"
    comm = "gloo"
    one_lane = False  # True: every process group's ops run on one thread, in order (worker groups.py, rule 4)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    # ------------------------------------------------------------ the device

    def start(self) -> None:
        """Tune this process for the device (rule 5); the worker calls it once, before serving."""
        if _LIBC is not None:
            _LIBC.mallopt(_M_ARENA_MAX, 1)  # every thread (executor, lanes, servers) shares the tuned heap
            _LIBC.mallopt(_M_MMAP_THRESHOLD, MAPPED_FROM)  # smaller buffers come from the heap...
            _LIBC.mallopt(_M_TRIM_THRESHOLD, 1 << 30)  # ...which keeps up to 1 GiB freed at its top for reuse

    def error_hint(self, e: BaseException) -> str:
        """What a user should know besides an op's error: after a device error (a CUDA device-side assert, such as
        an index out of range), the process's device context stays unusable, whatever op reports it."""
        if isinstance(e, getattr(torch, "AcceleratorError", ())):
            return (" (a device error leaves this worker's device unusable: every later op on it fails until the "
                    "worker process restarts; the op that caused it may be an earlier one, which "
                    "CUDA_LAUNCH_BLOCKING=1 on the worker names)")
        return ""

    def gather_by_all_to_all(self, ranks: int) -> bool:
        """Gather with an all_to_all of copies of the contribution rather than an all_gather (rule 4)."""
        return self.comm == "gloo" and ranks <= 8

    def check(self) -> None:
        """Raise ValueError with one line when this device cannot be used here."""
        if self.device.index not in (None, 0):
            raise ValueError(f"the {self.type} device has no index {self.device.index}")

    def activate(self) -> None:
        """Make this the current device of the calling thread (each worker thread that runs ops calls it)."""

    def identity(self) -> str:
        """The physical device, for the controller ("" for the host CPU, which any number of workers share)."""
        return ""

    def memory_bytes(self) -> int:
        """Memory the controller may plan with: the host's RAM for the CPU."""
        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            return 0

    def synchronize(self) -> None:
        """Wait until every operation queued on the device has finished."""

    # ------------------------------------------------------------ host copies

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of `nbytes`, for copies to and from the device (pinned where that helps)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous host tensor with the values of `t` (no copy when `t` already is one)."""
        t = t.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        return t.contiguous()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """`host` on this device (the CPU: as it is)."""
        return host

    def from_bytes(self, data: bytes | bytearray | memoryview, dtype: torch.dtype, shape: list[int]
                   ) -> torch.Tensor:
        """A tensor on this device from raw little-endian bytes (one copy through a host buffer)."""
        host = self.host_buffer(len(data))
        if len(data):
            host_bytes(host)[:] = data
        return self.to_device(typed(host, dtype, shape))

    # ------------------------------------------------------------ random numbers

    @contextmanager
    def seeded(self, seed: int) -> Iterator[None]:
        """Run under `torch.manual_seed(seed)` on this device's generator; its state is restored after."""
        with torch.random.fork_rng(devices=self._rng_devices()):
            torch.manual_seed(seed)
            yield

    def _rng_devices(self) -> list[int]:
        return []

    # ------------------------------------------------------------ collectives

    def completion(self, work: Any) -> Any:
        """What a lane waits on for a collective's Work (groups.Ctx.wait): an object with `wait(timeout) -> bool`,
        `is_set()` and `set()` (an abort wakes it), done when the op has finished. gloo completes the Work's
        future when the transfer is over."""
        done = threading.Event()
        work.get_future().add_done_callback(lambda _f: done.set())
        return done

    def new_group(self, store: Any, rank: int, size: int, timeout_s: float, host: str = "") -> Any:
        """A process group object of its own (not the default group) over `store`; blocks until every rank joined
        (gloo) or returns at once and connects at the first collective (NCCL). gloo listens on `host`, the host the
        worker is reached at (not whatever the machine's name resolves to), with one thread: a group runs one op
        at a time (groups.py)."""
        import torch.distributed as dist

        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        options._threads = 1
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host) if host
                            else dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, size, options)


class AcceleratorBackend(DeviceBackend):
    """A device with its own memory reached through a torch module (`torch.cuda`, `torch.xpu`, ...)."""

    module: Any = None

    def __init__(self, device: torch.device) -> None:
        super().__init__(torch.device(device.type, device.index or 0))  # "cuda" means "cuda:0"

    def check(self) -> None:
        if not self.module.is_available():
            raise ValueError(f"torch sees no {self.type} device here")
        count = self.module.device_count()
        if (self.device.index or 0) >= count:
            raise ValueError(f"only {count} {self.type} device{'s' if count != 1 else ''} here")

    def activate(self) -> None:
        self.module.set_device(self.device)

    def start(self) -> None:
        self.activate()  # host memory is staging only here: pinned buffers come from torch's caching allocator

    def memory_bytes(self) -> int:
        return int(self.module.get_device_properties(self.device.index or 0).total_memory)

    def identity(self) -> str:
        """host/uuid of the device: two workers on one GPU must not form an NCCL group (one rank per device)."""
        props = self.module.get_device_properties(self.device.index or 0)
        return f"{socket.gethostname()}/{getattr(props, 'uuid', self.device.index or 0)}"

    def synchronize(self) -> None:
        self.module.synchronize(self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        # pinned memory comes from torch's caching host allocator: reusing it costs nothing after the first time;
        # it is kept pinned, so only up to PINNED_MAX (rule 2)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=nbytes <= PINNED_MAX)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        t = DeviceBackend.to_host(self, t)  # resolved bits, contiguous, still on the device
        if t.device.type == "cpu":
            return t
        nbytes = t.numel() * t.element_size()
        host = typed(self.host_buffer(nbytes), t.dtype, list(t.shape))
        host.copy_(t, non_blocking=host.is_pinned())
        self._stream_synchronize()
        return host

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        out = host.to(self.device, non_blocking=host.is_pinned())
        if host.is_pinned():
            self._stream_synchronize()  # the pinned buffer goes back to the cache: the copy must be done with it
        return out

    def _stream_synchronize(self) -> None:
        """Wait for this thread's stream only: a device-wide synchronize would also wait for a collective stuck on
        a dead peer in another group (until its timeout)."""
        self.module.current_stream(self.device).synchronize()

    def completion(self, work: Any) -> Any:
        """Polled: NCCL (like other accelerators' libraries) marks a Work's future done when the op is queued on
        its stream, not when it finished; `Work.is_completed` asks the device without blocking."""
        return _Polled(work)

    def _rng_devices(self) -> list[int]:
        return [self.device.index or 0]


class CudaBackend(AcceleratorBackend):
    type = "cuda"
    comm = "nccl"
    module = torch.cuda
    one_lane = True  # NCCL: two communicators' kernels issued in different orders on two GPUs can deadlock

    def new_group(self, store: Any, rank: int, size: int, timeout_s: float, host: str = "") -> Any:
        import torch.distributed as dist

        # On a timeout NCCL's watchdog aborts the communicators and the wait raises; the default (3) would
        # tear the whole worker down, taking every other session's shards with it. For the same reason no debug
        # dump on a timeout: its signal goes through the rendezvous store, which every group meeting at that
        # worker shares, and the heartbeat monitor ends a process some minutes after it dumped.
        # An image's own setting of these (a launcher's defaults) is overridden, with a warning: it would do just that.
        for name, value in (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "0"),
                            ("TORCH_NCCL_ENABLE_MONITORING", "0")):
            if os.environ.get(name, value) != value:
                log.warning("%s=%s overridden with %s: a timed-out collective must fail its op, not end the worker",
                            name, os.environ[name], value)
            os.environ[name] = value
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        pg = dist.ProcessGroupNCCL(store, rank, size, options)
        # Connect now (torch's own eager init), on the lane, while every member is known to be there (the group's
        # rendezvous just met): NCCL initialises a communicator lazily at its first op otherwise, where a member
        # that failed before its first op leaves the others blocked in an init no wait of ours bounds or aborts.
        pg.eager_connect_single_device(self.device)
        return pg


class _Polled:
    """A device Work's completion, asked of the device with backoff (50 us doubling to 2 ms) and never blocking it;
    `set` ends the wait (an abort)."""

    def __init__(self, work: Any) -> None:
        self.work = work
        self._ended = False

    def set(self) -> None:
        self._ended = True

    def is_set(self) -> bool:
        return self._ended or bool(self.work.is_completed())  # True as well when the op failed: wait() raises

    def wait(self, timeout: float) -> bool:
        deadline, pause = time.monotonic() + timeout, 50e-6
        while not self.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 2e-3)
        return True


def fresh(shape: Sequence[int] | int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor the worker fills itself; a large one on the CPU in huge pages where the kernel
    allows (rule 5)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    nbytes = t.numel() * t.element_size()
    if _LIBC is not None and t.device.type == "cpu" and nbytes >= MAPPED_FROM:
        start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE  # the whole huge pages inside it
        end = (t.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)  # a hint: errors ignored
    return t


def typed(buf: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A uint8 buffer seen as a tensor of `dtype` and `shape` (no copy)."""
    if buf.numel() == 0:
        return torch.empty(list(shape), dtype=dtype, device=buf.device)
    return buf.view(dtype).reshape(list(shape))


def register(device_type: str, factory: _Factory) -> None:
    """Plug in the backend of a device type (see the module docstring)."""
    _REGISTRY[device_type] = factory


def device_types() -> list[str]:
    return sorted(_REGISTRY)


def backend_for(device: str | torch.device) -> DeviceBackend:
    """The backend of `device` ("cpu", "cuda:1", ...); ValueError names the registered types."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"bad device {str(device)!r} (expected one of {', '.join(device_types())}, "
                         "with :N for an index)") from None
    factory = _REGISTRY.get(dev.type)
    if factory is None:
        raise ValueError(f"no backend for device type {dev.type!r} (registered: {', '.join(device_types())})")
    return factory(dev)


register("cpu", DeviceBackend)
register("cuda", CudaBackend)
CPU = DeviceBackend(torch.device("cpu"))  # host-side work (wire buffers, backups in host memory)
