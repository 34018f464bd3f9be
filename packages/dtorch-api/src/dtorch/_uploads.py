"""The uploads a client keeps until the cluster holds them safely, so that a rebuild can ask for them again.

Rules:
  1. An upload is kept (a reference to the client's tensor, no copy, with its version counter) from the moment its
     adopt is queued until the controller says its copies for recovery are complete (`.safe` in the answer to a
     Submit or a KeepAlive: the controller's snapshots rule 7), or until a Sync that began after that is answered
     done: every worker then ran its batch, and those copies are complete (the controller's lineage rule 3).
     Memory: the client's tensors stay referenced about as long as their batch takes to run, plus a keep-alive
     period (1 s). A controller that rebuilds no session (`SessionOpened.recovery` False) asks for none: none is
     kept.
  2. A rebuild that lost the only bytes of some shards asks for them (`SyncReply.reput`, the controller's recovery
     rule 7): each is Put again to its device's worker now. A shard the worker has already (a Put that followed its
     device when it moved, `_relocate`) is left as it is. One asked for is kept past the Syncs that name it
     (`SyncReply.keep`) until it is safe: a snapshot holds it (the controller's snapshots rule 7).
  3. A tensor written in place since its upload (its version counter moved) cannot be Put again: that is an error
     naming it, and so is one this client no longer keeps. Asked in a Submit's or a KeepAlive's answer (the sender
     thread's, `_stream` rule 8), the error is raised at the end of the sync under way, else of the next one (`check`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from types import CodeType
from typing import TYPE_CHECKING

import torch

from dtorch._source import caller, src_text
from dtorch.errors import ClusterError

if TYPE_CHECKING:
    from dtorch._dataplane import DataPlane
    from dtorch._spec import Spec


@dataclass
class _Held:
    tensor: torch.Tensor  # the full tensor, as uploaded (the client's own when no conversion copied it)
    spec: Spec
    version: int  # tensor._version at the upload
    src: tuple[CodeType | None, int]  # the user's line that uploaded it (`_source.caller`: made a line only if needed)


class Uploads:
    """One session's kept uploads (rule 1), by tensor id; used from the user thread and a background fetch's."""

    def __init__(self, keeping: bool = True) -> None:
        self._keeping = keeping  # rule 1
        self._held: dict[int, _Held] = {}
        self._lock = threading.Lock()
        self._failed: Exception | None = None  # rule 3, for the next sync point

    def keep(self, tid: int, tensor: torch.Tensor, spec: Spec) -> None:
        """Call it after the adopt is queued: a Sync that began before cannot cover it then."""
        if not self._keeping:
            return
        with self._lock:
            self._held[tid] = _Held(tensor, spec, tensor._version, caller())

    def kept(self) -> list[int]:
        """The uploads a Sync beginning now covers once it is answered done."""
        with self._lock:
            return list(self._held)

    def safe(self, tids: Iterable[int], keep: Iterable[int] = ()) -> None:
        """Let go of these uploads, but those the controller keeps asking for (`SyncReply.keep`: rule 2)."""
        with self._lock:
            for tid in set(tids).difference(keep):
                self._held.pop(tid, None)

    def heard(self, reput: dict[int, list[int]], safe: list[int], data: DataPlane) -> None:
        """The controller's word on uploads in a Submit's or a KeepAlive's answer (rules 1 and 2), from a thread that
        must not raise (rule 3): the error is kept for `check`."""
        self.safe(safe)  # never one of `reput`: the controller holds back what it asked for again
        try:
            self.put_again(reput, data)
        except Exception as e:  # noqa: BLE001 - raised at the next sync point
            self._failed = self._failed or e

    def check(self) -> None:
        """Raise the error `heard` kept, once."""
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def put_again(self, reput: dict[int, list[int]], data: DataPlane) -> None:
        """Rule 2: the shards a rebuild asks for, to their devices' workers now."""
        for tid, devices in sorted(reput.items()):
            with self._lock:
                held = self._held.get(tid)
            if held is None or held.tensor._version != held.version:
                what = f"tensor {tid}" + (f" (uploaded at {src_text(*held.src)})" if held is not None else "")
                why = "this client no longer keeps it" if held is None else \
                    "its source tensor was written in place after the upload"
                raise ClusterError(f"a worker was lost with the only copy of {what} on logical devices "
                                   f"{sorted(devices)}, and it cannot be uploaded again: {why}")
            data.write(held.tensor, held.spec, tid, set(devices))
