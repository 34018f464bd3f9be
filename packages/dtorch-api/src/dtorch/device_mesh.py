"""DeviceMesh: an n-d array of this session's *logical* device ids (the controller maps them to workers).

Several logical devices may share one physical worker (virtual devices), so a program
written for 8 devices runs on 2 with the same results.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch

from dtorch.errors import DTorchError

_registry: dict[tuple, int] = {}
_registry_lock = threading.Lock()


def _ids_and_shape(ids: Any) -> tuple[list[int], list[int]]:
    if isinstance(ids, torch.Tensor):
        return [int(i) for i in ids.flatten().tolist()], list(ids.shape)
    if isinstance(ids, int):
        return [ids], []
    if not isinstance(ids, Sequence) or isinstance(ids, str):
        raise TypeError(f"DeviceMesh ids must be a (nested) list of ints or a tensor, got {type(ids).__name__}")
    if all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return list(ids), [len(ids)]
    parts = [_ids_and_shape(i) for i in ids]
    shapes = {tuple(s) for _, s in parts}
    if len(shapes) != 1:
        raise ValueError(f"DeviceMesh ids must be a rectangular nested list, got rows of shapes {sorted(shapes)}")
    return [i for flat, _ in parts for i in flat], [len(ids), *shapes.pop()]



def shape_of(mesh_id: int) -> tuple[int, ...]:
    """The shape of the mesh whose `id` this is (the id a wire spec names)."""
    with _registry_lock:
        return next(shape for (_, _, shape), i in _registry.items() if i == mesh_id)

# A DTensor's `.device`, whatever the mesh: the client's CPU, where the tensors that mix with it are made. The
# client holds no device memory; torch runs a tensor's backward on its device's queue and picks kernels by its device,
# so a "cuda" DTensor needed CUDA in the client (a client without it aborted) and a model's
# `torch.arange(n, device=x.device)` made a tensor on the client's GPU. The mesh says where the shards live.
WRAPPER_DEVICE = torch.device("cpu")


class DeviceMesh:
    """`DeviceMesh(device_type, ids, mesh_dim_names=None)`, as in torch.distributed but with no process groups."""

    def __init__(self, device_type: str, mesh: Any, mesh_dim_names: Sequence[str] | None = None) -> None:
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"DeviceMesh device_type must be 'cpu' or 'cuda', got {device_type!r}")
        flat, shape = _ids_and_shape(mesh)
        if not flat or not shape:
            raise ValueError("DeviceMesh needs at least one device id in a list, e.g. DeviceMesh('cpu', [0, 1])")
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in flat):
            raise ValueError(f"DeviceMesh ids must be non-negative ints, got {flat}")
        if len(set(flat)) != len(flat):
            raise ValueError(f"DeviceMesh ids must be distinct, got {flat}")
        names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        if names is not None and (len(names) != len(shape) or len(set(names)) != len(names)):
            raise ValueError(f"mesh_dim_names {list(names)} must name each of the mesh's {len(shape)} dims once")
        self.device_type = device_type
        self.devices: tuple[int, ...] = tuple(flat)
        self.shape: tuple[int, ...] = tuple(shape)
        self.mesh_dim_names = names
        key = (device_type, self.devices, self.shape)
        with _registry_lock:
            self.id = _registry.setdefault(key, len(_registry))
        self._torch_meshes: dict[int, Any] = {}
        self._root: DeviceMesh = self  # the mesh this one was sliced from, which keeps the flattened dims' names
        self._flattened: dict[str, DeviceMesh] = {}

    # ------------------------------------------------------------------ torch-like surface
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, mesh_dim: int | None = None) -> int:
        return math.prod(self.shape) if mesh_dim is None else self.shape[mesh_dim]

    @property
    def mesh(self) -> torch.Tensor:
        return torch.tensor(self.devices).reshape(self.shape)

    def tolist(self) -> Any:
        return self.mesh.tolist()

    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        """`mesh["tp"]`: the sub-mesh along named dims through coordinate 0 of the others."""
        if self.mesh_dim_names is None:
            raise KeyError("this DeviceMesh has no mesh_dim_names; name its dims to take a sub-mesh")
        wanted = (names,) if isinstance(names, str) else tuple(names)
        if len(wanted) == 1 and wanted[0] in self._root._flattened:
            return self._root._flattened[wanted[0]]
        unknown = [n for n in wanted if n not in self.mesh_dim_names]
        if unknown:
            raise KeyError(f"mesh dim {unknown[0]!r} not in {list(self.mesh_dim_names)}")
        dims = [self.mesh_dim_names.index(n) for n in wanted]
        index = tuple(slice(None) if d in dims else 0 for d in range(self.ndim))
        sub = self.mesh[index].permute(*[sorted(dims).index(d) for d in dims]) if len(dims) > 1 else self.mesh[index]
        out = DeviceMesh(self.device_type, sub, mesh_dim_names=wanted)
        out._root = self._root
        return out

    def _flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """torch's `mesh["dp", "cp"]._flatten("dp_cp")`: this mesh's devices as one dim, which the mesh it was
        sliced from then gives by that name (`root["dp_cp"]`)."""
        name = mesh_dim_name or "_".join(self.mesh_dim_names or ("flat",))
        flat, root = DeviceMesh(self.device_type, list(self.devices), mesh_dim_names=(name,)), self._root
        if name in (root.mesh_dim_names or ()) or root._flattened.get(name, flat) != flat:
            raise ValueError(f"DeviceMesh._flatten: {name!r} already names another dim of {root!r}")
        root._flattened[name] = flat
        flat._root, flat._flattened_from = root, self.mesh_dim_names or ()  # (the root's dims it flattens)
        return flat

    # torch's per-rank surface: an SPMD program asks which rank it is; a DTorch program runs once, on no rank.
    def get_rank(self) -> int:
        raise _no_rank("get_rank()")

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        raise _no_rank("get_local_rank()")

    def get_coordinate(self) -> list[int] | None:
        raise _no_rank("get_coordinate()")

    def get_group(self, mesh_dim: int | str | None = None) -> Any:
        raise _no_rank("get_group()")

    def get_all_groups(self) -> list[Any]:
        raise _no_rank("get_all_groups()")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and other.id == self.id and other.mesh_dim_names == self.mesh_dim_names

    def __hash__(self) -> int:
        return hash((self.id, self.mesh_dim_names))

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh('{self.device_type}', {self.tolist()}{names})"

    # ------------------------------------------------------------------ internals
    def torch_mesh(self, rank: int = 0) -> Any:
        """A process-group-free torch DeviceMesh for sharding propagation, seen from mesh position `rank`."""
        tm = self._torch_meshes.get(rank)
        if tm is None:
            from torch.distributed.device_mesh import DeviceMesh as TorchMesh

            tm = TorchMesh("cpu", torch.arange(len(self.devices)).reshape(self.shape),
                           mesh_dim_names=self.mesh_dim_names, _init_backend=False, _rank=rank)
            self._torch_meshes[rank] = tm
        return tm


def on_root(mesh: DeviceMesh, dim: int, flattened: bool = False) -> tuple[DeviceMesh, tuple[int, ...]]:
    """Mesh dim `dim` of a named slice of a larger mesh (`mesh["tp"]`, `mesh["dp"]`) as an SPMD program means it when
    it lays a model or buffers out: that dim of the whole mesh. torch's ranks each pass their own slice; this program
    runs once, for all of them, so torchtitan's `parallelize_module(model, mesh["tp"], plan)` then
    `fully_shard(model, mesh=mesh["dp"])` lay the parameters out over the whole mesh, as `tp_mesh_dim="tp"` and
    `mesh_dim="dp"` on it do. With `flattened`, a flattened dim (`mesh["dp", "cp"]._flatten("dp_cp")`) is the whole
    mesh's dims it flattens, each sharding in turn (nested: the flattened order). Any other mesh is its own."""
    root, names = mesh._root, mesh.mesh_dim_names or ()
    if root is mesh or not names:
        return mesh, (dim,)
    if names[dim] in (root.mesh_dim_names or ()):
        return root, (root.mesh_dim_names.index(names[dim]),)
    of = getattr(mesh, "_flattened_from", ())
    if flattened and of and set(of) <= set(root.mesh_dim_names or ()):
        return root, tuple(root.mesh_dim_names.index(n) for n in of)
    return mesh, (dim,)


# torch's SPMD entry points that ask a mesh for its rank -> DTorch's own, which a ported program calls instead
COUNTERPARTS = {
    "fully_shard": "dtorch.nn.fully_shard",
    "parallelize_module": "dtorch.nn.parallelize_module",
    "distribute_module": "dtorch.distribute_module",
    "distribute_tensor": "dtorch.distribute_tensor",
    "from_local": "dtorch.DTensor.from_local",
    "context_parallel": "dtorch.experimental.context_parallel",
}


def _no_rank(what: str) -> DTorchError:
    line = (f"dtorch: DeviceMesh.{what}: the client has no rank and no process group (the program runs once, and the "
            "workers form the groups its moves need); placements say what each device holds")
    f, called = sys._getframe(2), None
    while f is not None:  # torch's own entry point given a DTorch mesh (the outermost: the user's call)
        if f.f_code.co_name in COUNTERPARTS and f.f_globals.get("__name__", "").startswith("torch.distributed"):
            called = f.f_code.co_name
        f = f.f_back
    if called is None:
        return DTorchError(line)
    return DTorchError(f"{line}. torch's {called} was given a dtorch.DeviceMesh: call {COUNTERPARTS[called]}")


def init_device_mesh(device_type: str, mesh_shape: Sequence[int],
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """Like torch's `init_device_mesh`: logical ids 0..N-1 laid out in `mesh_shape`."""
    n = math.prod(mesh_shape)
    return DeviceMesh(device_type, torch.arange(n).reshape(tuple(mesh_shape)), mesh_dim_names=mesh_dim_names)
