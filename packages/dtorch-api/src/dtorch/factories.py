"""Creating DTensors: random and constant factories, `distribute_tensor`, `from_local`, and the session RNG seed.

Also optimizer state loaded from a checkpoint (`optimizer.load_state_dict`): it arrives as plain tensors, and each
one shaped like its DTensor parameter is laid out like it before the optimizer's next step (a global step pre-hook,
`_lay_out_loaded_state`); torch's update would otherwise write into plain tensors, which DTorch refuses.

Random factories give the same values whatever the mesh and placements: the global tensor is cut into fixed
blocks, each drawn from a seed of (the factory's seed, drawn from torch's generator, and the block's index), and
each worker draws only the blocks its box overlaps (`dtorch_worker.random_blocks`), so generation costs O(shard)
per device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dtorch import _dispatch
from dtorch._source import user_src
from dtorch._spec import Spec, check_dense, check_dtype, contiguous_stride, normalize_placements
from dtorch.device_mesh import DeviceMesh
from dtorch.dtensor import DTensor
from dtorch.runtime import get_session
from dtorch_protocol import messages as m
from dtorch_protocol.placement_types import Partial, Placement, Replicate, Shard
from dtorch_protocol.values import divide

_RANDOM = ("rand", "randn")


def _shape(size: tuple) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in size):
        raise ValueError(f"size must be non-negative ints, got {size}")
    return tuple(size)


def _check_mesh(name: str, mesh: Any) -> DeviceMesh:
    if mesh is None:
        raise ValueError(f"dtorch.{name} needs device_mesh=, e.g. dtorch.DeviceMesh('cpu', [0, 1])")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a dtorch.DeviceMesh, got {type(mesh).__name__}")
    return mesh


def _create(init: str, shape: tuple[int, ...], mesh: DeviceMesh | None, placements: Sequence[Placement] | None,
            dtype: torch.dtype | None, requires_grad: bool, value: Any = None, arange: list | None = None) -> DTensor:
    hook = _dispatch.owned_hook()
    if hook is not None:  # in a compiled step (dtorch.steps): an operation of its own
        key = ("create", init, shape, getattr(mesh, "id", None), tuple(placements or ()), dtype, requires_grad,
               type(value), value, tuple(arange or ()))
        return hook.run(key, [], lambda: _create(init, shape, mesh, placements, dtype, requires_grad, value, arange))
    mesh = _check_mesh(init, mesh)
    dtype = dtype or torch.get_default_dtype()
    check_dtype(f"dtorch.{init}", dtype)
    if init in _RANDOM and not dtype.is_floating_point:
        raise TypeError(f"dtorch.{init} needs a floating point dtype, got {dtype}")
    spec = Spec(mesh, normalize_placements(placements, mesh, len(shape)), shape, contiguous_stride(shape), dtype)
    session = get_session()
    session.ensure_mesh(mesh)
    tid = session.new_tid()
    session.emit(m.InstrCreate(tid=tid, spec=spec.wire, init=init, value=value, arange=arange,
                               seed=session.next_seed() if init in _RANDOM else 0, src=user_src(3)))
    return DTensor(spec, tid, session, requires_grad=requires_grad)


def rand(*size: Any, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> DTensor:
    return _create("rand", _shape(size), device_mesh, placements, dtype, requires_grad)


def randn(*size: Any, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
          dtype: torch.dtype | None = None, requires_grad: bool = False) -> DTensor:
    return _create("randn", _shape(size), device_mesh, placements, dtype, requires_grad)


def zeros(*size: Any, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
          dtype: torch.dtype | None = None, requires_grad: bool = False) -> DTensor:
    return _create("zeros", _shape(size), device_mesh, placements, dtype, requires_grad)


def ones(*size: Any, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> DTensor:
    return _create("ones", _shape(size), device_mesh, placements, dtype, requires_grad)


def empty(*size: Any, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
          dtype: torch.dtype | None = None, requires_grad: bool = False) -> DTensor:
    return _create("empty", _shape(size), device_mesh, placements, dtype, requires_grad)


def full(size: Sequence[int], fill_value: Any, *, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None, dtype: torch.dtype | None = None,
         requires_grad: bool = False) -> DTensor:
    if dtype is None:
        dtype = torch.tensor(fill_value).dtype if not isinstance(fill_value, float) else torch.get_default_dtype()
    return _create("full", _shape((size,)), device_mesh, placements, dtype, requires_grad, value=fill_value)


def arange(start: Any, end: Any = None, step: Any = 1, *, device_mesh: DeviceMesh | None = None,
           placements: Sequence[Placement] | None = None, dtype: torch.dtype | None = None,
           requires_grad: bool = False) -> DTensor:
    if end is None:
        start, end = 0, start
    meta = torch.arange(start, end, step, dtype=dtype, device="meta")
    return _create("arange", tuple(meta.shape), device_mesh, placements, meta.dtype, requires_grad,
                   arange=[start, end, step])


def distribute_tensor(tensor: torch.Tensor, device_mesh: DeviceMesh, placements: Sequence[Placement] | None = None,
                      *, src_data_rank: int | None = 0) -> DTensor:
    """Shard a full torch tensor from the client onto the mesh (data goes straight to the workers); a meta tensor
    has no values, and its shards are allocated on the workers uninitialized, as `torch.empty`. `src_data_rank`
    (torch's: which rank's tensor is the source) changes nothing: the client's tensor is the only one."""
    if isinstance(tensor, DTensor):
        raise TypeError("distribute_tensor takes a plain torch.Tensor; use .redistribute() on a DTensor")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute_tensor takes a torch.Tensor, got {type(tensor).__name__}")
    if torch._C._functorch.is_functorch_wrapped_tensor(tensor):  # its values live in no memory of its own
        raise NotImplementedError("dtorch: distribute_tensor got a tensor of a torch.func transform (grad, vmap, "
                                  "jacrev), which DTorch cannot upload or lay out (a parallel style's hook does: "
                                  "tensor-parallel modules under torch.func.grad); take gradients with "
                                  "loss.backward() or torch.autograd.grad instead")
    check_dense("distribute_tensor", tensor)
    mesh = _check_mesh("distribute_tensor", device_mesh)
    shape = tuple(tensor.shape)
    if tensor.is_meta:  # no values to upload: shards allocated on the workers, as torch.empty
        return _create("empty", shape, mesh, placements, tensor.dtype, tensor.requires_grad)
    spec = Spec(mesh, normalize_placements(placements, mesh, len(shape)), shape, contiguous_stride(shape),
                tensor.dtype)
    session = get_session()
    tid = session.upload(tensor, spec)
    return DTensor(spec, tid, session, requires_grad=tensor.requires_grad)


def _lay_out(tensor: torch.Tensor, device_mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """`distribute_tensor`, differentiable where `tensor` requires grad: its gradient comes back whole to the client
    (torch's `distribute_tensor` makes a leaf; `from_local` is differentiable)."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _LayOut.apply(tensor, device_mesh, tuple(placements))
    return distribute_tensor(tensor, device_mesh, placements)


class _LayOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
        return distribute_tensor(tensor.detach(), mesh, placements)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[torch.Tensor, None, None]:
        return grad.full_tensor(), None, None


# How the local tensors of one mesh dim's devices make the tensor they stand for (`from_local`), by placement. Partial
# ones combine in mesh order, as every path that reduces does (`dtorch_protocol.values.reduce_in_order`), but out of
# place, so that autograd sees it.
_REDUCE = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}
_COMBINE = {
    Shard: lambda group, p: torch.cat(group, p.dim),
    Replicate: lambda group, p: group[0],
    Partial: lambda group, p: _reduce(group, p.reduce_op),
}


def _reduce(group: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = functools.reduce(_REDUCE[op], group)
    return divide(acc, len(group)) if op == "avg" and len(group) > 1 else acc  # (acc is a new tensor here)


def from_local(local_tensor: torch.Tensor | Sequence[torch.Tensor], device_mesh: DeviceMesh | None = None,
               placements: Sequence[Placement] | None = None, *, run_check: bool = False,
               shape: Sequence[int] | None = None, stride: Sequence[int] | None = None,
               grad_placements: Sequence[Placement] | None = None) -> DTensor:
    """torch's `DTensor.from_local`, for a program that runs once: `local_tensor` is each device's local tensor (as
    when every rank of an SPMD program passes the same one: `from_local(torch.ones(2), mesh, [Shard(0)])` has
    2 x mesh.size() ones), or a list of them, one per device in the mesh's row-major order. The DTensor is the
    tensor they stand for under `placements` (Shard: concatenated, Partial: reduced in mesh order, Replicate: the
    first device's; `run_check=True` checks that replicated ones are equal), laid out as `distribute_tensor` lays it
    out. Differentiable: each local tensor gets the gradient the chain rule gives it. `grad_placements` is checked and
    otherwise changes nothing: in torch it picks the layout of the gradient each rank's local tensor receives, and
    here the local tensors are the client's own."""
    mesh = _check_mesh("from_local", device_mesh)
    tensors = list(local_tensor) if isinstance(local_tensor, (list, tuple)) else [local_tensor] * mesh.size()
    if len(tensors) != mesh.size():
        raise ValueError(f"from_local: got {len(tensors)} local tensors for a mesh of {mesh.size()} devices; pass "
                         "one tensor (every device's) or one per device, in the mesh's row-major order")
    for t in tensors:
        if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
            raise TypeError(f"from_local takes plain torch.Tensors (the local ones), got {type(t).__name__}")
        check_dense("from_local", t)
        if t.dtype != tensors[0].dtype or t.dim() != tensors[0].dim():
            raise ValueError(f"from_local: the local tensors differ: {t.dtype} with {t.dim()} dims against "
                             f"{tensors[0].dtype} with {tensors[0].dim()}; every device's must have the same dtype "
                             "and number of dims")
    target = normalize_placements(placements, mesh, tensors[0].dim())
    normalize_placements(grad_placements, mesh, tensors[0].dim())
    dims = list(mesh.shape)
    while dims:  # the last mesh dim varies fastest: combine its groups, then the next one out
        k, p = dims.pop(), target[len(dims)]
        groups = [tensors[i:i + k] for i in range(0, len(tensors), k)]
        if run_check and isinstance(p, Replicate) and any(not torch.equal(t, g[0]) for g in groups for t in g):
            raise ValueError(f"from_local(run_check=True): the local tensors of mesh dim {len(dims)} are "
                             "Replicate() but not equal")
        tensors = [_COMBINE[type(p)](g, p) for g in groups]
    full = tensors[0]
    if shape is not None and tuple(shape) != tuple(full.shape):
        raise ValueError(f"from_local: the local tensors make a tensor of shape {list(full.shape)} under {target}, "
                         f"not shape={list(shape)}")
    if stride is not None and tuple(stride) != contiguous_stride(tuple(full.shape)):
        raise ValueError(f"from_local: stride={list(stride)} is not the contiguous stride of shape "
                         f"{list(full.shape)}, {list(contiguous_stride(tuple(full.shape)))}; DTorch lays the tensor "
                         "out contiguously")
    return _lay_out(full, mesh, target)


DTensor.from_local = staticmethod(from_local)  # torch's spelling; set here, where uploads are (`dtorch.DTensor` loads
# this module)


def manual_seed(seed: int) -> None:
    """`torch.manual_seed(seed)`, from whose generator DTensor random ops draw their seeds: the same seed gives the
    same values under any mesh and placements."""
    torch.manual_seed(seed)


def _lay_out_loaded_state(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    """Before every optimizer step (module doc): scans a state dict it has not seen yet, once (a load replaces the
    dict; torch's own steps add DTensor entries to it in place), so a step otherwise costs one comparison."""
    state = optimizer.state
    if getattr(optimizer, "_dtorch_state_seen", None) is state:
        return
    optimizer._dtorch_state_seen = state  # type: ignore[attr-defined]
    for group in optimizer.param_groups:
        for p in group["params"]:
            if type(p) is not DTensor or p not in state:
                continue
            entries = state[p]
            for key, value in entries.items():
                if type(value) is torch.Tensor and value.ndim and value.shape == p.shape:
                    entries[key] = distribute_tensor(value, p.device_mesh, p.placements)


register_optimizer_step_pre_hook(_lay_out_loaded_state)
