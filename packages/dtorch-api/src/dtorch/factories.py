"""Creating DTensors: random and constant factories, `distribute_tensor`, and the session RNG seed.

Also optimizer state loaded from a checkpoint (`optimizer.load_state_dict`): it arrives as plain tensors, and each
one shaped like its DTensor parameter is laid out like it before the optimizer's next step (a global step pre-hook,
`_lay_out_loaded_state`); torch's update would otherwise write into plain tensors, which DTorch refuses.

Random factories give the same values whatever the mesh and placements: the global tensor is cut into fixed
blocks, each drawn from a seed of (the factory's seed, drawn from torch's generator, and the block's index), and
each worker draws only the blocks its box overlaps (`dtorch_worker.random_blocks`), so generation costs O(shard)
per device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dtorch import _dispatch
from dtorch._source import user_src
from dtorch._spec import Spec, contiguous_stride, normalize_placements
from dtorch.device_mesh import DeviceMesh
from dtorch.dtensor import DTensor
from dtorch.runtime import get_session
from dtorch_protocol import messages as m
from dtorch_protocol.placement_types import Placement

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
                      ) -> DTensor:
    """Shard a full torch tensor from the client onto the mesh (data goes straight to the workers); a meta tensor
    has no values, and its shards are allocated on the workers uninitialized, as `torch.empty`."""
    if isinstance(tensor, DTensor):
        raise TypeError("distribute_tensor takes a plain torch.Tensor; use .redistribute() on a DTensor")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute_tensor takes a torch.Tensor, got {type(tensor).__name__}")
    if torch._C._functorch.is_functorch_wrapped_tensor(tensor):  # its values live in no memory of its own
        raise NotImplementedError("dtorch: distribute_tensor got a tensor of a torch.func transform (grad, vmap, "
                                  "jacrev), which DTorch cannot upload or lay out (a parallel style's hook does: "
                                  "tensor-parallel modules under torch.func.grad); take gradients with "
                                  "loss.backward() or torch.autograd.grad instead")
    mesh = _check_mesh("distribute_tensor", device_mesh)
    shape = tuple(tensor.shape)
    if tensor.is_meta:  # no values to upload: shards allocated on the workers, as torch.empty
        return _create("empty", shape, mesh, placements, tensor.dtype, tensor.requires_grad)
    spec = Spec(mesh, normalize_placements(placements, mesh, len(shape)), shape, contiguous_stride(shape),
                tensor.dtype)
    session = get_session()
    tid = session.upload(tensor, spec)
    return DTensor(spec, tid, session, requires_grad=tensor.requires_grad)


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
