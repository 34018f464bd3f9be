"""DTensor: a `torch.Tensor` subclass that holds no data, only a global spec and a tensor id.

Every aten op on it goes through `__torch_dispatch__` (see `_dispatch`), which queues an
instruction and returns a new DTensor at once. Values come back only at sync points:
`to_torch()`, `print`/`repr`, `.item()`, `.tolist()`, `bool(x)`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import _foreach_supported_types as _optim_foreach_types
from torch.utils._foreach_utils import _foreach_supported_types as _util_foreach_types

from dtorch import _dataplane, _dispatch, _setitem
from dtorch._source import user_src
from dtorch._spec import Spec, contiguous_stride, normalize_placements
from dtorch.device_mesh import WRAPPER_DEVICE, DeviceMesh
from dtorch.errors import DTorchError
from dtorch_protocol.placement_types import Partial, Placement, Replicate

if TYPE_CHECKING:
    from dtorch.session import Session


_make_wrapper = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided
_BASE_DATA = torch._C.TensorBase.data  # the `data` attribute DTensor's own property wraps


class DTensor(torch.Tensor):
    # slots, not the instance dict torch.Tensor gives: no dict is made per op's output, and `__del__` reads them
    # faster (together a quarter of a microsecond of the user thread's per-op path)
    __slots__ = ("_spec", "_tid", "_session", "_origin")  # _origin: `_views.Origin`, set on views of moved copies
    _spec: Spec
    _tid: int
    _session: Session

    @staticmethod
    def __new__(cls, spec: Spec, tid: int, session: Session, requires_grad: bool = False) -> DTensor:
        # positional (size, strides, storage_offset, memory_format, dtype, layout, device, pin_memory,
        # requires_grad): a third cheaper than keywords; strides None for contiguous ones, cheaper still
        r = _make_wrapper(cls, spec.shape, None if spec.contiguous else spec.stride, None, None, spec.dtype,
                          _STRIDED, WRAPPER_DEVICE, False, requires_grad)
        r._spec, r._tid, r._session = spec, tid, session
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    __torch_dispatch__ = classmethod(_dispatch.torch_dispatch)  # no frame of its own: the hot path counts

    def __del__(self) -> None:
        try:
            self._session.release(self._tid)
        except AttributeError:  # never finished: nothing to free
            pass

    @property
    def data(self) -> torch.Tensor:
        return _BASE_DATA.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """`p.data = q`, as `nn.Module.to(dtype)`, `.half()` and `.double()` convert parameters and gradients: `p`
        becomes `q` (its tensor id, layout, session and metadata; `q`'s release frees `p`'s old shards). torch's own
        setter would change the metadata alone and leave `p` naming its old shards. A plain `q` is laid out as `p`
        is first (transformers' `resize_token_embeddings` gives a parallelized model's embedding a plain tensor of
        the new size this way)."""
        if not isinstance(new, DTensor):
            placements = normalize_placements(_gradient_placements(self.placements), self.device_mesh, new.dim())
            new = _upload(self._session, new.detach(), self.device_mesh, placements)
        _BASE_DATA.__set__(self, new)
        self._spec, new._spec = new._spec, self._spec
        self._tid, new._tid = new._tid, self._tid
        self._session, new._session = new._session, self._session

    def __setitem__(self, index: Any, value: Any) -> None:
        """`x[i] = v`: on a dim `x` is sharded on, each device writes its own rows (`_setitem`); else torch's."""
        where = _setitem.region(self, index, value)
        if where is None:
            return super().__setitem__(index, value)
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            value = _dispatch.replicate_plain(value.detach(), self)
        hook = _dispatch.owned_hook()
        if hook is None:
            _setitem.write(self, where, value)
        else:  # an operation of a compiled step (`_capture`)
            tensor = isinstance(value, DTensor)
            key = ("setitem", self._spec.sid, where, value._spec.sid if tensor else (type(value), value))
            hook.run(key, [self, value] if tensor else [self], lambda: _setitem.write(self, where, value))
        torch.autograd.graph.increment_version(self)
        return None

    def __copy__(self) -> DTensor:
        """`copy.copy`: as torch's, a tensor that shares the data (an alias on the workers: writes to either show in
        both) with the same `requires_grad`, a leaf; torch's default would pickle it whole and give a plain tensor."""
        new = self.detach().requires_grad_(self.requires_grad)
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict) -> DTensor:
        """A copy on the cluster with the same placements (`copy.deepcopy` of a parallelized model): torch's
        default would copy the tensor id and the session's connection."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        new.requires_grad_(self.requires_grad)
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))  # torch's own marks (`_is_param`, hooks' ids)
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        """`torch.save` and pickle write the whole tensor as a plain one (a sync point): `torch.save(model.state_dict(),
        path)` is a checkpoint that `torch.load` reads anywhere, and `load_state_dict` of a parallelized model shards
        again. (A DTensor is a handle into one session's cluster; the handle itself means nothing elsewhere.)"""
        full = self._read()
        if self.requires_grad and full.is_floating_point():
            full.requires_grad_(True)
        return full.__reduce_ex__(protocol)

    def to_local(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Refused: torch's DTensor gives its rank's shard; the client has no rank and holds no shard."""
        raise DTorchError("dtorch: DTensor.to_local(): the client holds no shard (the shards live on the workers, and "
                          "the code runs once, not per rank); use .to_torch() (or .full_tensor()) for the whole tensor")

    # ------------------------------------------------------------------ metadata
    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    # ------------------------------------------------------------------ sync points
    def to_torch(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole tensor as a plain torch.Tensor on the client (a sync point). Differentiable, as torch's
        `full_tensor()`: a loss computed from it sends its gradient back laid out as this tensor is (a Partial mesh
        dim as Replicate), or as `grad_placements`."""
        if grad_placements is not None:
            grad_placements = normalize_placements(grad_placements, self.device_mesh, self.dim())
        if self.requires_grad and torch.is_grad_enabled():  # (its way back uploads: `distribute_tensor`'s path)
            return _FullTensor.apply(self, grad_placements)
        return self._read()

    def _read(self) -> torch.Tensor:
        """The whole tensor, read (no autograd)."""
        values = self._combined()
        return self._session.fetch(values._tid, values._spec)

    def _combined(self) -> DTensor:
        """This DTensor, or where it is a Partial one of SHARDED_MIN_BYTES or more, its values combined on the
        workers into 1/n of the tensor on each device (`Spec.sharded_instead`): one copy comes back to the client,
        not one per device. A smaller one is read as it is and combined on the client, in the same order with the
        same function (`reduce_in_order`), without a collective on the way: either way a read has the bits of
        `redistribute(placements=[Replicate()])`."""
        if not self._spec.has_partial() or self.numel() * self.element_size() < _dataplane.SHARDED_MIN_BYTES:
            return self
        return _dispatch.redistribute_to(self, self.device_mesh, self._spec.sharded_instead(Partial), user_src())

    full_tensor = to_torch

    def to_torch_async(self) -> Future:
        """Like `to_torch()`, but returns at once with a Future of the tensor as it is now: later in-place
        writes do not show (the workers copy it first, as torch's non-blocking copies read the source now)."""
        now = self._combined()  # a new tensor where it combines
        if now is self:
            with torch.no_grad():
                now = torch.ops.aten.clone.default(self)
        future = self._session.fetch_async(now._tid, now._spec)
        alive = [now]  # the copy is not freed before it is read
        future.add_done_callback(lambda _: alive.clear())
        return future

    def tolist(self) -> Any:
        return self._read().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self._read().numpy()

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        """The whole tensor, as `numpy()` gives it (a sync point): the wrapper has no memory, and its capsule pointed
        at address 0, which a consumer (`numpy.from_dlpack`) read."""
        return self._read().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU: the copy `__dlpack__` gives is in this process

    def apply_(self, callable: Any) -> DTensor:
        """`callable` on every element, in this process as torch runs it (a sync point: the whole tensor comes to
        the client and goes back laid out as before). torch's ran it over the wrapper, which has no memory, and
        crashed the process."""
        values = self._read()
        values.apply_(callable)
        with torch.no_grad():
            self.copy_(values)
        return self

    def share_memory_(self) -> DTensor:
        """Refused in one line (torch's reached for the wrapper's storage, which it has not, and crashed the process):
        `model.share_memory()` for torch.multiprocessing shares memory of this process, and a DTensor's shards
        live on the workers."""
        raise DTorchError("dtorch: share_memory_(): a DTensor's shards live on the workers, not in this process's "
                          "memory; processes share them through the session (or .full_tensor() for a plain copy)")

    def __format__(self, format_spec: str) -> str:
        """`f"{loss:.4f}"`: a 0-dim DTensor formats its value, as a plain tensor does (a sync point)."""
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"DTensor({self._read()!r}, device_mesh={self.device_mesh!r}, placements={self.placements}{grad})"

    def backward(self, gradient: torch.Tensor | None = None, retain_graph: bool | None = None,
                 create_graph: bool = False, inputs: Any = None) -> None:
        """torch's; a plain `gradient` (the whole tensor's) is laid out as this tensor first, as an op lays out the
        plain tensors it mixes in, so the gradients it makes are DTensors (they were plain ones, on DTensor leaves)."""
        if isinstance(gradient, torch.Tensor) and not isinstance(gradient, DTensor):
            gradient = _upload(self._session, gradient.to(self.dtype), self.device_mesh,
                               _gradient_placements(self.placements))
        super().backward(gradient, retain_graph, create_graph, inputs)

    # ------------------------------------------------------------------ layout
    def redistribute(self, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None, *,
                     async_op: bool = False, forward_dtype: torch.dtype | None = None,
                     backward_dtype: torch.dtype | None = None) -> DTensor:
        """The same values laid out by `placements` on `device_mesh` (default: this mesh); differentiable. As in
        torch, `forward_dtype` casts before the move (the result has that dtype) and `backward_dtype` casts the
        gradient before its move back (which then ends in this tensor's dtype). `async_op` changes nothing: every
        DTorch op returns at once, and its moves run while the program goes on."""
        mesh = device_mesh or self.device_mesh
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"device_mesh must be a dtorch.DeviceMesh, got {type(mesh).__name__}")
        if placements is None:
            if mesh != self.device_mesh:
                raise ValueError("redistribute to another mesh needs placements=")
            placements = self.placements
        target = normalize_placements(placements, mesh, len(self.shape))
        return _Redistribute.apply(self, mesh, target, forward_dtype or self.dtype, backward_dtype or self.dtype)


# As torch's DTensor does: optimizers and `clip_grad_norm_` take their `_foreach_` paths for DTensors where they
# would for plain tensors (fewer, wider ops: one per parameter group instead of one per parameter).
for _types in (_optim_foreach_types, _util_foreach_types):
    if DTensor not in _types:
        _types.append(DTensor)


def wrap(spec: Spec, tid: int, session: Session) -> DTensor:
    """`DTensor(spec, tid, session)` without the type call: for per-op paths (a replayed step's ops)."""
    r = _make_wrapper(DTensor, spec.shape, None if spec.contiguous else spec.stride, None, None, spec.dtype,
                      _STRIDED, WRAPPER_DEVICE)
    r._spec, r._tid, r._session = spec, tid, session
    return r


def _gradient_placements(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """The layout a gradient goes back in to a tensor of `placements`: a Partial mesh dim becomes Replicate."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


class _Redistribute(torch.autograd.Function):
    """Forward: cast to `forward_dtype`, move to the target layout. Backward: cast the gradient to `backward_dtype`,
    move it back, cast it to the input's dtype."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, mesh: DeviceMesh, placements: tuple[Placement, ...],
                forward_dtype: torch.dtype, backward_dtype: torch.dtype) -> DTensor:
        ctx.src_mesh, ctx.src_placements = x.device_mesh, x.placements
        ctx.dtype, ctx.backward_dtype = x.dtype, backward_dtype
        cast = x if x.dtype == forward_dtype else x.to(forward_dtype)
        out = _dispatch.redistribute_to(cast, mesh, placements, user_src(4))
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None, None, None]:
        if grad.dtype != ctx.backward_dtype:
            grad = grad.to(ctx.backward_dtype)
        back = _dispatch.redistribute_to(grad, ctx.src_mesh, _gradient_placements(ctx.src_placements), user_src(2))
        return (back if back.dtype == ctx.dtype else back.to(ctx.dtype)), None, None, None, None


class _FullTensor(torch.autograd.Function):
    """Forward: the whole tensor, read. Backward: its gradient laid out again on the mesh."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, grad_placements: tuple[Placement, ...] | None) -> torch.Tensor:
        ctx.mesh, ctx.session = x.device_mesh, x._session
        ctx.placements = grad_placements or _gradient_placements(x.placements)
        return x._read()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor, None]:
        if isinstance(grad, DTensor):
            return grad.redistribute(ctx.mesh, ctx.placements), None
        return _upload(ctx.session, grad, ctx.mesh, ctx.placements), None


def _upload(session: Session, tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
    """A plain tensor of the client laid out on `mesh` (`distribute_tensor`'s path, below it)."""
    spec = Spec(mesh, placements, tuple(tensor.shape), contiguous_stride(tuple(tensor.shape)), tensor.dtype)
    return DTensor(spec, session.upload(tensor, spec), session)
