"""Parallelism as configuration: lay out an unmodified nn.Module's parameters and activations on a mesh.

* `distribute_module(module, mesh, partition_fn, input_fn, output_fn)`: torch's lowest-level module API, each
  submodule laid out by a function of the user's, the rest replicated, inputs and outputs converted by hooks.
* `parallelize_module(module, mesh, plan)`: tensor parallelism by ParallelStyle (torch's names), expert
  parallelism by `ExpertParallel`; every parameter and buffer not named by the plan is replicated, so the
  whole model runs on the mesh. One plan per mesh dim: call it once per dim (`tp_mesh_dim`).
* data parallelism: no plan (all replicated) and inputs `Shard(0)` on the `dp` mesh dim; gradients come
  out `Partial` over `dp` and are reduced as soon as autograd has accumulated each one (a post-accumulate-grad
  hook on every parameter placed here issues the redistribution to the parameter's placements), so the
  all-reduce of one layer's gradient runs on the workers while the rest of the backward pass computes.
* `fully_shard(module, mesh)`: FSDP/ZeRO-style, parameters stored `Shard(0)` over a mesh dim and gathered
  for their submodule's forward (hooks, as torch's FSDP2); the gather's backward reduce-scatters the gradient.
* `place_on_mesh(module, {submodule: mesh})`: pipeline stages on sub-meshes; activations move between
  stage meshes by `redistribute(device_mesh=...)`. Calling the model on micro-batches in turn
  (`microbatch_forward`) pipelines them, since each worker runs its own instruction stream.
* `copy_weights(src, dst)`: RL hand-off, one redistribute per parameter into another mesh and layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import inspect
import itertools
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from dtorch._spec import from_torch_placement
from dtorch.device_mesh import DeviceMesh, on_root
from dtorch.dtensor import DTensor
from dtorch.factories import distribute_tensor
from dtorch.nn import _fsdp_module, _reshard
from dtorch.nn._buckets import Gather, GatherAgain, Member
from dtorch.nn.style import ParallelStyle, as_style
from dtorch_protocol.placement_types import Placement, Replicate, Shard


def _mesh_dim(mesh: DeviceMesh, dim: int | str) -> int:
    if isinstance(dim, str):
        if mesh.mesh_dim_names is None or dim not in mesh.mesh_dim_names:
            raise ValueError(f"mesh dim {dim!r} is not one of the mesh's dim names {mesh.mesh_dim_names}")
        return mesh.mesh_dim_names.index(dim)
    if not -mesh.ndim <= dim < mesh.ndim:
        raise ValueError(f"mesh dim {dim} is out of range for a {mesh.ndim}-d mesh")
    return dim % mesh.ndim


def _lays_out(lay_out: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """What every entry point keeps of the model it lays out:

    * parameters that several submodules share (tied input and output embeddings: GPT-2, T5, BERT's heads) stay
      one parameter: the entry points lay parameters out submodule by submodule, which gave every use a copy of its
      own, trained apart. After the layout, each other use takes the first use's parameter;
    * a transformers model's `save_pretrained` writes the full weights (`save_pretrained` below, bound to the
      model under transformers' name, which is also how pickle finds a bound method again);
    * `load_state_dict(..., assign=True)` keeps the layout (`_keep_layouts`);
    * `torch.save(model)` is refused in one line saying what to save (`_SaveGuard`); it failed with pickle's
      "Can't pickle local object '_apply_style.<locals>.post_hook'";
    * gradient accumulation without communication, as DDP's `model.no_sync()` and FSDP2's
      `set_requires_gradient_sync(False)`: both are bound to the module, and every parameter the layout armed that
      no `fully_shard` group owns answers to the module's `_GradSync` (`_reduce_early`)."""
    @functools.wraps(lay_out)
    def run(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        uses: dict[int, list[tuple[nn.Module, str]]] = {}
        for mod in module.modules():
            for name, p in mod._parameters.items():
                if p is not None:
                    uses.setdefault(id(p), []).append((mod, name))
        result = lay_out(module, *args, **kwargs)
        for (mod, name), *others in (u for u in uses.values() if len(u) > 1):
            shared = mod._parameters[name]
            for other, other_name in others:
                other.register_parameter(other_name, shared)
        if callable(getattr(type(module), "save_pretrained", None)):
            module.save_pretrained = types.MethodType(save_pretrained, module)
        _keep_layouts(module)
        if not any(type(h) is _SaveGuard for h in module._forward_hooks.values()):
            module.register_forward_hook(_SaveGuard(), prepend=True)  # (pickle reads a module's hooks first)
        module.__dict__.setdefault("_dtorch_grad_sync", _GradSync())
        _answer_to_grad_sync(module)
        for method in (set_requires_gradient_sync, no_sync):
            setattr(module, method.__name__, types.MethodType(method, module))
        return result
    return run


class _GradSync:
    """Whether the backward reduces the gradients of the parameters a layout gave a module (`_reduce_early`)."""

    def __init__(self) -> None:
        self.sync = True


def _answer_to_grad_sync(module: nn.Module) -> None:
    """The armed parameters of a laid-out `module` that no `fully_shard` group (nor an inner layout) owns answer to
    its `_GradSync`."""
    flag = module.__dict__["_dtorch_grad_sync"]
    for p in module.parameters():
        if getattr(p, "_dtorch_armed", False) and getattr(p, "_dtorch_sync", None) is None:
            p._dtorch_sync = flag


class _SaveGuard:
    """A forward hook that does nothing but refuse to be pickled: `torch.save(model)` pickles the module object,
    with the hooks the layout put on it, where a checkpoint is the state dict. Copies (`copy.deepcopy(model)`) take
    it along."""

    def __call__(self, *_args: Any) -> None:
        return None

    def __deepcopy__(self, _memo: dict) -> _SaveGuard:
        return self

    def __reduce_ex__(self, _protocol: Any) -> Any:
        raise TypeError("torch.save(model) pickles a module DTorch laid out, hooks and all: save its state dict, "
                        "torch.save(model.state_dict(), path), which writes the full weights as plain tensors "
                        "(load_state_dict lays them out again), or save_pretrained(path) for a transformers model")


def save_pretrained(self: nn.Module, *args: Any, state_dict: dict | None = None, **kwargs: Any) -> Any:
    """transformers' `save_pretrained`, given the model's full weights: safetensors reads each tensor's memory, and a
    DTensor's wrapper has none ("invalid python storage"). Tied weights stay one tensor."""
    if state_dict is None:
        whole: dict[int, torch.Tensor] = {}
        state_dict = {key: whole.setdefault(id(v), v.full_tensor()) if isinstance(v, DTensor) else v
                      for key, v in self.state_dict().items()}
    return type(self).save_pretrained(self, *args, state_dict=state_dict, **kwargs)


def _with(placements: tuple[Placement, ...], dim: int | tuple[int, ...], p: Placement,
          ndim: int) -> tuple[Placement, ...]:
    """`placements` with `p` on mesh dim `dim` (or on each of several)."""
    if isinstance(p, Shard) and p.dim < 0:
        p = Shard(p.dim % max(ndim, 1))
    out = list(placements)
    for d in (dim,) if isinstance(dim, int) else dim:
        out[d] = p
    return tuple(out)


def _set_param(module: nn.Module, name: str, value: torch.Tensor, requires_grad: bool) -> None:
    param = nn.Parameter(value, requires_grad=requires_grad)
    if isinstance(value, DTensor):
        _arm(module, name, param)
    module.register_parameter(name, param)


def _arm(module: nn.Module, name: str, param: torch.Tensor) -> None:
    """What DTorch's layout gives a DTensor parameter: its gradient reduced as it lands (`_reduce_early`) and, under
    `fully_shard`, its module's gradient sync (`_Gathered.sync`)."""
    if param.requires_grad and not getattr(param, "_dtorch_armed", False):
        param._dtorch_armed = True
        param.register_post_accumulate_grad_hook(_reduce_early)
    hooks = getattr(module, "_dtorch_gathered", None)
    if hooks is not None and name in hooks.names:
        param._dtorch_sync = hooks  # (`_reduce_early` asks it whether to reduce)


def _keep_layouts(module: nn.Module) -> None:
    """`load_state_dict(..., assign=True)` (torch's way to fill a model laid out on the meta device) puts the state
    dict's tensors in the parameters' places: a plain one is laid out as the tensor it replaces first (it made the
    model plain: uploaded at each use, its optimizer failing at the step), and each DTensor parameter put in gets
    what the layout gave the one it replaces (`_arm`)."""
    if not getattr(module, "_dtorch_keeps_layouts", False):
        module._dtorch_keeps_layouts = True
        module.register_load_state_dict_pre_hook(_lay_out_assigned)
        module.register_load_state_dict_post_hook(_arm_assigned)


def _lay_out_assigned(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *_: Any) -> None:
    if not local_metadata.get("assign_to_params_buffers"):
        return
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        value = state_dict.get(prefix + name)
        if isinstance(t, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                and value.shape == t.shape:
            state_dict[prefix + name] = distribute_tensor(value.detach(), t.device_mesh, t.placements)


def _arm_assigned(module: nn.Module, _incompatible: Any) -> None:
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if isinstance(p, DTensor):
                _arm(mod, name, p)
    if "_dtorch_grad_sync" in module.__dict__:
        _answer_to_grad_sync(module)


def _reduce_early(param: torch.Tensor) -> None:
    """A gradient autograd just accumulated that is not laid out as its parameter (Partial over a sharded batch,
    Replicate where every device computed the whole of it) is laid out as it now, what the optimizer's first use
    would do later: issued here, a collective overlaps the rest of backward, and a replicated gradient is held once,
    not on every device. A plain one (torch's formulas that make their zeros with a factory taking no tensor: `sgn`,
    `copysign`'s sign) becomes a DTensor laid out as the parameter. A `fully_shard` parameter's gradient accumulates
    unreduced while its module does not synchronize gradients (`_Gathered.sync`, or the laid-out module's `_GradSync`:
    `no_sync()`)."""
    grad = param.grad
    if isinstance(param, DTensor) and grad is not None and not isinstance(grad, DTensor):
        param.grad = torch.zeros_like(param) if grad._is_zerotensor() else \
            distribute_tensor(grad.detach(), param.device_mesh, param.placements)
        return
    if not isinstance(grad, DTensor) or not isinstance(param, DTensor) or grad.device_mesh != param.device_mesh \
            or grad.placements == param.placements:
        return
    owner = getattr(param, "_dtorch_sync", None)
    if owner is None or owner.sync:
        param.grad = grad.redistribute(placements=param.placements)


def _distribute(t: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
    if isinstance(t, DTensor):
        return t.redistribute(device_mesh=mesh, placements=placements)
    return distribute_tensor(t.detach(), mesh, placements)


def to_layout(x: Any, mesh: DeviceMesh, dim: int, layout: Placement | None, given: Placement | None = None) -> Any:
    """Move one activation's placement on mesh dim `dim` to `layout`. A plain tensor is the whole value (the program
    runs once): it is distributed first, sharded on `dim` as `given` where that is a Shard (a style's
    `input_layouts`: each device is sent its part, as each rank of torch's program holds its own), else replicated."""
    if layout is None or not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        first = (Replicate(),) * mesh.ndim
        sharded = isinstance(given, Shard) and -x.ndim <= given.dim < x.ndim
        x = distribute_tensor(x, mesh, _with(first, dim, given, x.ndim) if sharded else first)
    if x.device_mesh != mesh:
        x = x.redistribute(device_mesh=mesh, placements=(Replicate(),) * mesh.ndim)
    target = _with(x.placements, dim, layout, x.ndim)
    return x if target == x.placements else x.redistribute(placements=target)


def _apply_style(module: nn.Module, style: ParallelStyle, mesh: DeviceMesh, dim: int, name: str = "") -> None:
    style.prepare(module, name or type(module).__name__, mesh, dim)
    replicate = (Replicate(),) * mesh.ndim
    for name, p in list(module.named_parameters(recurse=False)):
        placement = style.param_placements(module, name)
        placements = replicate if placement is None else _with(replicate, dim, placement, p.ndim)
        _set_param(module, name, _distribute(p, mesh, placements), p.requires_grad)
    given, desired = style.input_layouts_for(module)
    kw_given = getattr(style, "input_kwarg_layouts", {}) or {}
    kw_desired = getattr(style, "desired_input_kwarg_layouts", {}) or {}
    if desired or kw_desired:
        def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            args = tuple(to_layout(a, mesh, dim, _nth(desired, i), _nth(given, i)) for i, a in enumerate(args))
            kwargs = {k: to_layout(v, mesh, dim, kw_desired.get(k), kw_given.get(k)) for k, v in kwargs.items()}
            return args, kwargs

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    out_layout = style.output_layouts_for(module)
    if out_layout is not None:
        def post_hook(_mod: nn.Module, _args: Any, output: Any) -> Any:
            if isinstance(output, (tuple, list)):
                layouts = out_layout if isinstance(out_layout, (tuple, list)) else (out_layout,) * len(output)
                return type(output)(to_layout(o, mesh, dim, lay) for o, lay in zip(output, layouts))
            return to_layout(output, mesh, dim, out_layout)

        module.register_forward_hook(post_hook)


def _nth(layouts: Any, i: int) -> Any:
    return layouts[i] if layouts and i < len(layouts) else None


@_lays_out
def replicate_module(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Every parameter and buffer that is still a plain tensor becomes a Replicate DTensor on `mesh`."""
    for mod in module.modules():
        _replicate_own(mod, mesh, keep=lambda t: isinstance(t, DTensor))
    return module


def _replicate_own(mod: nn.Module, mesh: DeviceMesh, keep: Any) -> None:
    """Replicate one module's own parameters and buffers (not its children's) on `mesh`, except `keep(t)`."""
    replicate = (Replicate(),) * mesh.ndim
    for name, p in list(mod.named_parameters(recurse=False)):
        if not keep(p):
            _set_param(mod, name, _distribute(p, mesh, replicate), p.requires_grad)
    for name, b in list(mod.named_buffers(recurse=False)):
        if b is not None and not keep(b):
            mod.register_buffer(name, _distribute(b, mesh, replicate),
                                persistent=name not in mod._non_persistent_buffers_set)


@_lays_out
def distribute_module(module: nn.Module, device_mesh: DeviceMesh | None = None,
                      partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
                      input_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
                      output_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None) -> nn.Module:
    """`torch.distributed.tensor.distribute_module`: `partition_fn(name, submodule, mesh)` lays out each submodule's
    own parameters (registering DTensor parameters, as with torch), and every parameter and buffer it leaves plain is
    replicated; `input_fn(module, inputs, mesh)` runs before each forward and `output_fn(module, outputs, mesh)`
    after it, their results replacing the inputs and outputs. Once per module."""
    if device_mesh is None:
        raise ValueError("distribute_module needs a device_mesh (DTorch keeps no current mesh)")
    if getattr(module, "_distribute_module_applied", False):
        raise RuntimeError("distribute_module should only be called once on a module, but it has already been "
                           "called on this module")
    for fn, what in ((input_fn, "input_fn(module, inputs, device_mesh)"),
                     (output_fn, "output_fn(module, outputs, device_mesh)")):
        if fn is not None and len(inspect.signature(fn).parameters) != 3:
            raise ValueError(f"{what} takes 3 arguments; this one takes {len(inspect.signature(fn).parameters)}")
    for name, submodule in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, submodule, device_mesh)
        _replicate_own(submodule, device_mesh, keep=lambda t: isinstance(t, DTensor))
    if input_fn is not None:
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda mod, _inputs, outputs: output_fn(mod, outputs, device_mesh))
    module._distribute_module_applied = True  # type: ignore[assignment]
    return module


@_lays_out
def parallelize_module(module: nn.Module, device_mesh: DeviceMesh,
                       parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle] | None = None, *,
                       tp_mesh_dim: int | str = -1, src_data_rank: int | None = 0) -> nn.Module:
    """Apply `parallelize_plan` (a style, or {submodule name pattern: style}) on mesh dim `tp_mesh_dim`.

    `src_data_rank` (torch's: which rank's weights the others take, or None for each its own) is accepted and
    changes nothing: the module on the client holds the only weights, which are laid out as they are.

    Patterns use fnmatch wildcards (`"layers.*.mlp.up_proj"`). Everything the plan does not name is
    replicated. Returns the module, changed in place. torch's own styles (`torch.distributed.tensor.parallel`) are
    taken as the DTorch styles of the same names and fields.
    """
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a dtorch.DeviceMesh, got {type(device_mesh).__name__}")
    device_mesh, (dim,) = on_root(device_mesh, _mesh_dim(device_mesh, tp_mesh_dim))
    parallelize_plan = as_style(parallelize_plan)
    if isinstance(parallelize_plan, ParallelStyle):
        _apply_style(module, parallelize_plan, device_mesh, dim)
    elif parallelize_plan is not None and not isinstance(parallelize_plan, Mapping):
        raise TypeError(f"parallelize_plan must be a ParallelStyle or a {{submodule name: style}} dict, got "
                        f"{type(parallelize_plan).__name__}")
    elif parallelize_plan:
        names = [name for name, _ in module.named_modules()]
        for pattern, style in parallelize_plan.items():
            style = as_style(style)
            if not isinstance(style, ParallelStyle):
                raise TypeError(f"plan entry {pattern!r} must be a ParallelStyle, got {type(style).__name__}")
            matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                raise ValueError(f"parallelize_plan key {pattern!r} matches no submodule of "
                                 f"{type(module).__name__}")
            for name in matched:
                _apply_style(module.get_submodule(name), style, device_mesh, dim, name)
    return replicate_module(module, device_mesh)


@dataclasses.dataclass(frozen=True)
class _Precision:
    """torch's `MixedPrecisionPolicy` for one `fully_shard` call: parameters gathered in `param_dtype` (None: their
    own), gradients reduced in `reduce_dtype` (None: `param_dtype`) and kept in the parameter's dtype, the forward's
    floating point inputs cast to `param_dtype` (`cast_forward_inputs`) and its outputs to `output_dtype`."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @classmethod
    def of(cls, policy: Any) -> _Precision:
        if policy is None:
            return cls()
        fields = [f.name for f in dataclasses.fields(cls)]
        if not all(hasattr(policy, f) for f in fields):
            raise TypeError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
                            f"{type(policy).__name__}")
        return cls(**{f: getattr(policy, f) for f in fields})

    def member(self, p: DTensor, placements: tuple[Placement, ...], reduce: bool) -> Member:
        """`p` gathered to `placements` in the forward's dtype, its gradient reduced in `reduce_dtype` (or, where
        not `reduce`, left as the backward makes it: FSDP2's `set_requires_gradient_sync(False)`)."""
        dtype = self.param_dtype or p.dtype
        return Member(p, placements, dtype, (self.reduce_dtype or dtype) if reduce else None)

    def cast(self, dtype: torch.dtype | None, tree: Any) -> Any:
        if dtype is None:
            return tree
        return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)

    def inputs(self, _mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self.cast(self.param_dtype if self.cast_forward_inputs else None, (args, kwargs))

    def outputs(self, _mod: nn.Module, _args: Any, output: Any) -> Any:
        return self.cast(self.output_dtype, output)


class _Gathered:
    """`fully_shard`'s hooks on one submodule: its forward sees the parameters `names` gathered on mesh dims `dims`
    (a forward pre-hook puts the gathered tensors in their places, a forward hook puts the sharded parameters back);
    the gather is differentiable, so each sharded parameter gets its gradient, reduce-scattered (in the dtypes of
    `precision`, a mixed-precision policy). The parameters come gathered from their call's `_Group` (`ready`), or,
    for a forward outside the group's, are gathered here, together (`_buckets`). With `reshard`, autograd saves no
    gathered tensor for backward, which gathers again (`_reshard`). A forward that writes a gathered parameter in
    place (`nn.Embedding(max_norm=...)` renormalizes the rows it looks up) has the write copied into the sharded
    parameter, as the module's own parameter would keep it."""

    def __init__(self, names: list[str], dims: tuple[int, ...], reshard: bool, precision: _Precision) -> None:
        self.names, self.dims, self.reshard, self.precision = names, dims, reshard, precision
        self.sync = True  # gradients reduced in each backward (`set_requires_gradient_sync`)
        self.held = False  # gathered by `unshard()` and kept until FSDP2 would reshard them
        self.stored: dict[str, tuple[nn.Parameter, torch.Tensor, int]] = {}
        self.ready: dict[str, tuple[DTensor, GatherAgain | None]] = {}  # gathered by the group's forward, for it
        self.hooks: list[Any] = []  # per call under way (nested ones too): the saved-tensor hooks it entered, or None

    def members(self, mod: nn.Module) -> list[tuple[str, Member]]:
        """The parameters to gather now (not in place already, as in a nested call of the module), by name."""
        out = []
        for name in self.names:
            p = mod._parameters.get(name)
            if isinstance(p, DTensor) and name not in self.stored and name not in self.ready:
                unreduced = p.grad is not None and p.grad.placements != p.placements  # (from unsynced backwards)
                out.append((name, self.precision.member(p, _with(p.placements, self.dims, Replicate(), p.ndim),
                                                        reduce=self.sync and not unreduced)))
        return out

    def gather(self, mod: nn.Module, _args: Any) -> None:
        if self.held:  # unsharded (`unshard()`): the gathered parameters are in place already
            self.hooks.append(None)
            return
        self._put_gathered(mod, track=self.reshard)
        self.hooks.append(_reshard.install() if self.reshard else None)

    def restore(self, mod: nn.Module, _args: Any, _output: Any) -> None:
        hooks = self.hooks.pop() if self.hooks else None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        if not self.held or (self.reshard and not self.hooks):  # (FSDP2 reshards held ones after forward too)
            self.held = False
            self._put_back(mod)

    def hold(self, mod: nn.Module) -> None:
        """FSDP2's `unshard()`: the parameters gathered now and kept in place for the forwards until FSDP2 would
        reshard them (`unshard`)."""
        if not self.held and not self.hooks:  # (not inside its own forward)
            self._put_gathered(mod, track=False)
            self.held = True

    def release(self, mod: nn.Module) -> None:
        if self.held:
            self.held = False
            self._put_back(mod)

    def _put_gathered(self, mod: nn.Module, track: bool) -> None:
        wholes = {**self.ready, **_gather(self.members(mod), self.reshard and track)}
        for name, (whole, again) in wholes.items():
            if name in self.stored:
                continue
            p = mod._parameters[name]
            self.stored[name] = (p, whole, whole._version)
            mod._parameters[name] = whole
            if track and again is not None:
                _reshard.track(whole, p, again)

    def _put_back(self, mod: nn.Module) -> None:
        for name, (p, whole, version) in self.stored.items():
            if whole._version != version:
                with torch.no_grad():
                    p.copy_(whole)
            mod._parameters[name] = p
            _reshard.untrack(whole)
        self.stored.clear()


class _Group:
    """One `fully_shard` call's parameters (FSDP2's parameter group): gathered together when the forward of the
    module given to the call starts (one collective per bucket, `_buckets`), handed to each submodule's forward
    inside it (`_Gathered.ready`) and dropped from here when it ends; their gradients are reduced together when
    the group's backward ends."""

    def __init__(self, units: list[tuple[nn.Module, _Gathered]]) -> None:
        self.units = units
        self.depth = 0  # calls of the module under way

    def fill(self, track: bool, after: tuple[Callable[[], None], ...] = ()) -> None:
        """Every unit's parameters not in place yet gathered together, into its `ready` (`after`: called when
        their gradients are reduced)."""
        named = [((unit, name), mb) for mod, unit in self.units if not unit.held for name, mb in unit.members(mod)]
        reshard = track and any(u.reshard for _, u in self.units)
        for (unit, name), (whole, again) in _gather(named, reshard, after).items():
            unit.ready[name] = (whole, again if unit.reshard else None)

    def release(self) -> None:
        for mod, unit in self.units:
            unit.release(mod)

    def clear(self) -> None:
        for _mod, unit in self.units:
            unit.ready.clear()

    def gather(self, _mod: nn.Module, _args: Any) -> None:
        self.depth += 1
        if self.depth == 1:
            self.fill(track=True)

    def done(self, _mod: nn.Module, _args: Any, _output: Any) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.clear()


def _gather(named: list[tuple[Any, Member]], reshard: bool, after: tuple[Callable[[], None], ...] = ()
            ) -> dict[Any, tuple[DTensor, GatherAgain | None]]:
    """The members gathered together (a differentiable `Gather`): name -> (gathered, what gathers it again for
    backward, with `reshard`); `after` is called when their gradients are reduced."""
    if not named:
        return {}
    members = tuple(mb for _, mb in named)
    again = GatherAgain(members) if reshard else None
    wholes = Gather.apply(members, after if again is None else (*after, again.release),
                          *(mb.param for mb in members))
    return {name: (whole, again) for (name, _), whole in zip(named, wholes)}


def _fsdp_base(p: DTensor, name: str, mod: nn.Module, mesh: DeviceMesh, dims: tuple[int, ...]) -> tuple:
    """The placements a parameter already laid out keeps beside `fully_shard`'s on `dims` of `mesh`; refused in one
    line where it lives on another mesh or is already sharded on those dims (its layout would be lost)."""
    where = f"fully_shard: parameter {name!r} of {type(mod).__name__}"
    if p.device_mesh != mesh:
        raise ValueError(f"{where} lives on {p.device_mesh!r}, not on {mesh!r}: lay tensor parallelism and FSDP out "
                         "on one mesh (or on named slices of one: mesh[\"tp\"], mesh[\"dp\"])")
    taken = [d for d in dims if not p.placements[d].is_replicate()]
    if taken:
        raise ValueError(f"{where} is already {p.placements[taken[0]]} on mesh dim {taken[0]} of {mesh!r}; give "
                         "fully_shard the data-parallel dim (mesh_dim=, or mesh[\"dp\"])")
    return p.placements


def _shard_of(param: nn.Parameter, shard_placement_fn: Callable[[nn.Parameter], Any] | None) -> Shard:
    """Where `fully_shard` shards a parameter: `Shard(0)`, or what torch's `shard_placement_fn` says."""
    placement = from_torch_placement(shard_placement_fn(param)) if shard_placement_fn is not None else None
    if placement is None:
        return Shard(0)
    if not isinstance(placement, Shard) or not -param.ndim <= placement.dim < param.ndim:
        raise ValueError(f"fully_shard: shard_placement_fn gave {placement!r} for a parameter of shape "
                         f"{list(param.shape)}; expected Shard(dim) with a dim of it, or None")
    return Shard(placement.dim % param.ndim)


@_lays_out
def fully_shard(module: nn.Module, device_mesh: DeviceMesh | None = None, *, mesh: DeviceMesh | None = None,
                mesh_dim: int | str = -1, reshard_after_forward: bool | int | None = None, mp_policy: Any = None,
                shard_placement_fn: Callable[[nn.Parameter], Any] | None = None, offload_policy: Any = None,
                ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """FSDP/ZeRO-3 style: parameters stored Shard(0) over `mesh_dim`, gathered for their submodule's forward.

    `mesh_dim` defaults to the mesh's last dim, as torch's: a 1-D mesh shards over it, and a 2-D one is HSDP,
    parameters sharded over dim 1 and replicated over dim 0 (give the batch `Shard(0)` on both, and gradients are
    reduce-scattered over dim 1 and all-reduced over dim 0).

    As with torch's FSDP2, `module.weight` is the sharded parameter under its own name (`named_parameters()`,
    `state_dict()` and `.grad` as the model's, sharded), and only the submodule's forward sees it whole. The
    call's parameters are gathered together when `module`'s forward starts, and their gradients reduced together
    when its backward ends: one collective each way, as FSDP2's flat buffers (`_buckets`). A use
    outside that forward (another module reading a tied weight) reads the sharded parameter, which DTorch's ops take
    as any other layout. Works on a plain module (other mesh dims replicated) or on one already tensor-parallel on
    the same mesh (the stored layout adds Shard(0) on `mesh_dim`). Optimizer state follows the sharded parameters,
    so it is sharded too.

    `reshard_after_forward` (torch's name): True frees the gathered parameters when the submodule's forward ends and
    gathers them again for its backward, so a training step holds one submodule's gathered parameters at a time on
    each worker, not the whole model's (`_reshard`); False keeps them from forward to backward (one gather fewer per
    parameter and step). None, torch's default, is torch's heuristic: False for the root (the outermost module given
    to `fully_shard`, whose parameters the backward needs first) and True for the blocks inside it (a module given
    before, then inside a later call, becomes a block); an int (torch's resharding to a smaller group) is True.

    torch's `shard_placement_fn(param)` gives a parameter's `Shard(dim)` (None: `Shard(0)`), as for expert weights
    sharded on another dim; `ignored_params` stay as they are; `offload_policy` may only be torch's plain
    `OffloadPolicy()`: the shards stay on the workers' devices (`CPUOffloadPolicy` is refused).

    The module given becomes an instance of torch's `FSDPModule`, as with FSDP2 (its class `FSDP<Class>`), with
    FSDP2's `set_requires_gradient_sync(bool)` (gradient accumulation with no reduction until the last micro-batch),
    `set_reshard_after_forward(bool)`, and `unshard()` / `reshard()` (its parameters gathered ahead and kept as
    FSDP2 keeps them: across forwards without backward, as for generation); its hints that change no value
    (prefetching) are taken with nothing to do, and its other settings are refused in one line (`_fsdp_module`).

    `mp_policy`: torch's `MixedPrecisionPolicy` (`torch.distributed.fsdp`): the parameters are gathered in
    `param_dtype` and the gradients reduced in `reduce_dtype` (None: `param_dtype`; or the parameter's own dtype),
    stored in the parameter's dtype, as the optimizer keeps them; the module's floating point inputs are cast to
    `param_dtype` (`cast_forward_inputs`) and its outputs to `output_dtype`.

    The mesh is given positionally or as torch's `mesh=`. As with torch, blocks may be sharded first and the root
    last (`for block in model.layers: fully_shard(block, mesh)`, then `fully_shard(model, mesh)`): a submodule
    already sharded keeps its layout and its own gathers. A model built on the meta device is laid out without
    values, its shards allocated on the workers (then `model.to_empty(device=...)` and initialize in place, or
    `load_state_dict`).
    """
    if (device_mesh is None) == (mesh is None):
        raise TypeError("fully_shard needs one mesh: fully_shard(module, mesh) or fully_shard(module, mesh=mesh)")
    device_mesh = device_mesh or mesh
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"fully_shard's mesh must be a dtorch.DeviceMesh, got {type(device_mesh).__name__}")
    device_mesh, dims = on_root(device_mesh, _mesh_dim(device_mesh, mesh_dim), flattened=True)
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise NotImplementedError(f"fully_shard: offload_policy={type(offload_policy).__name__}: DTorch keeps the "
                                  "shards on the workers' devices; give no offload_policy")
    auto = reshard_after_forward is None  # the root's for now: False (see the docstring)
    reshard_after_forward = not auto and bool(reshard_after_forward)
    ignored = {id(p) for p in ignored_params or ()}
    precision = _Precision.of(mp_policy)
    replicate = (Replicate(),) * device_mesh.ndim
    groups: list[tuple[nn.Module, _Gathered]] = []  # (submodule, its hooks) of this call: FSDP2's parameter group
    for mod in list(module.modules()):
        if getattr(mod, "_dtorch_gathered", None) is not None:  # sharded by an earlier call (per block, then root)
            continue
        names = []
        for name, p in list(mod.named_parameters(recurse=False)):
            if not p.ndim or id(p) in ignored:
                continue
            base = _fsdp_base(p, name, mod, device_mesh, dims) if isinstance(p, DTensor) else replicate
            shard = _shard_of(p, shard_placement_fn)  # laid out once, where it is stored (a meta one allocated there)
            _set_param(mod, name, _distribute(p, device_mesh, _with(base, dims, shard, p.ndim)), p.requires_grad)
            names.append(name)
        if names:
            mod._dtorch_gathered = hooks = _Gathered(names, dims, reshard_after_forward, precision)
            mod.register_forward_pre_hook(hooks.gather)
            mod.register_forward_hook(hooks.restore, always_call=True)
            for name in names:
                _arm(mod, name, mod._parameters[name])
            groups.append((mod, hooks))
    module._dtorch_group = group = _Group(groups)
    if groups:
        module.register_forward_pre_hook(group.gather, prepend=True)
        module.register_forward_hook(group.done, always_call=True)
    for sub in module.modules():  # an earlier call's root by default inside this one is one of its blocks now
        if sub is not module and getattr(sub, "_dtorch_auto", False):
            sub._dtorch_auto = False
            for _mod, hooks in sub._dtorch_group.units:
                hooks.reshard = True
    module._dtorch_auto = auto
    _fsdp_module.adopt(module, {f.__name__: f for f in (set_reshard_after_forward, unshard, reshard,
                                                        set_requires_gradient_sync)})
    if precision.param_dtype is not None and precision.cast_forward_inputs:
        module.register_forward_pre_hook(precision.inputs, with_kwargs=True)
    if precision.output_dtype is not None:
        module.register_forward_hook(precision.outputs)
    return replicate_module(module, device_mesh)


# What torch's `fully_shard` adds to the modules it is given (FSDP2's `FSDPModule`), bound to each of them. Without
# `recurse`, a method acts on the parameters of the module's own call (FSDP2's parameter group), not on those of
# submodules given to `fully_shard` before it.
def set_requires_gradient_sync(self: nn.Module, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
    """FSDP2's gradient accumulation without communication: while False, each backward leaves the parameters'
    gradients unreduced (Partial over a sharded batch, the size of the whole parameter on each device) and adds to
    them there; the first backward with True reduces the sum once, to the parameters' layout. On a module laid out
    otherwise (data parallel, tensor parallel), the same for the parameters its layout gave it."""
    for _mod, hooks in _fully_sharded(self, recurse):
        hooks.sync = requires_gradient_sync
    for m in self.modules() if recurse else [self]:
        if "_dtorch_grad_sync" in m.__dict__:
            m._dtorch_grad_sync.sync = requires_gradient_sync


@contextlib.contextmanager
def no_sync(self: nn.Module) -> Iterator[None]:
    """DDP's `with model.no_sync():` the backwards inside accumulate the gradients unreduced (no collective), and the
    first backward after the block reduces their sum once (`set_requires_gradient_sync(False)`, then True)."""
    set_requires_gradient_sync(self, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(self, True)


def set_reshard_after_forward(self: nn.Module, reshard_after_forward: bool, recurse: bool = True) -> None:
    """FSDP2's: whether the next forwards free their gathered parameters at their end (`fully_shard`'s argument;
    what it sets, a later `fully_shard` of an outer module keeps)."""
    for m in self.modules() if recurse else [self]:
        if getattr(m, "_dtorch_auto", False):
            m._dtorch_auto = False
    for _mod, hooks in _fully_sharded(self, recurse):
        hooks.reshard = reshard_after_forward


def unshard(self: nn.Module, async_op: bool = False) -> _Unsharded | None:
    """FSDP2's (not recursive): this module's parameters gathered now and kept in place, as FSDP2 keeps them, until
    `reshard()`, the end of a forward where the module reshards after forward, or the end of their backward (FSDP2's
    post-backward reshard: the optimizer's step then updates the shards, and the next forward gathers them again).
    The root, which does not reshard after forward, keeps them across forwards without backward, as for generation,
    which would otherwise gather and free them once per token. The gathers run asynchronously either way; with
    `async_op`, the handle's `wait()` returns at once."""
    group = getattr(self, "_dtorch_group", None)
    if group is not None:
        group.fill(track=False, after=(group.release,))
        for mod, hooks in group.units:
            hooks.hold(mod)
        group.clear()
    return _Unsharded() if async_op else None


def reshard(self: nn.Module) -> None:
    """FSDP2's: the gathered parameters `unshard()` kept are freed; forwards gather their own again."""
    group = getattr(self, "_dtorch_group", None)
    if group is not None:
        group.release()


class _Unsharded:
    """FSDP2's `UnshardHandle`: its gathers are queued on the workers like any op, so there is nothing to wait for."""

    def wait(self) -> None:
        return None


def _fully_sharded(module: nn.Module, recurse: bool) -> list[tuple[nn.Module, _Gathered]]:
    if not recurse:
        group = getattr(module, "_dtorch_group", None)
        return list(group.units) if group is not None else []
    return [(m, m._dtorch_gathered) for m in module.modules() if getattr(m, "_dtorch_gathered", None) is not None]


@_lays_out
def place_on_mesh(module: nn.Module, stages: Mapping[str, DeviceMesh]) -> nn.Module:
    """Pipeline stages: each named submodule's parameters live on its mesh, and its inputs move there.

    Submodules not named inherit the mesh of their nearest named ancestor, else the first stage's.
    Activations (positional and keyword DTensors) are moved with `redistribute(device_mesh=...)`.
    """
    if not stages:
        raise ValueError("place_on_mesh needs at least one {submodule name: mesh} entry")
    for name in stages:
        module.get_submodule(name)  # a clear AttributeError for a wrong name
    first = next(iter(stages.values()))

    def mesh_of(name: str) -> DeviceMesh:
        best = max((s for s in stages if s == "" or name == s or name.startswith(s + ".")), key=len, default=None)
        return stages[best] if best is not None else first

    for name, mod in module.named_modules():
        mesh = mesh_of(name)
        _replicate_own(mod, mesh, keep=lambda t, mesh=mesh: isinstance(t, DTensor) and t.device_mesh == mesh)
    for name, mesh in stages.items():
        target = mesh

        def move(_mod: nn.Module, args: tuple, kwargs: dict, target: DeviceMesh = target) -> tuple[tuple, dict]:
            hop = lambda v: v.redistribute(device_mesh=target, placements=(Replicate(),) * target.ndim) \
                if isinstance(v, DTensor) and v.device_mesh != target else v  # noqa: E731
            return pytree.tree_map(hop, (args, kwargs))

        module.get_submodule(name).register_forward_pre_hook(move, with_kwargs=True)
    return module


def microbatch_forward(module: nn.Module, batch: torch.Tensor, microbatches: int, **kwargs: Any) -> torch.Tensor:
    """Run `module` on `microbatches` slices of the batch in turn and concatenate: a GPipe-style schedule.

    Each stage's workers start on micro-batch i+1 as soon as they finished micro-batch i, so stages
    overlap without any schedule code: the instruction streams are asynchronous.
    """
    outs = [module(mb, **kwargs) for mb in batch.chunk(microbatches, dim=0)]
    if hasattr(outs[0], "logits"):
        return torch.cat([o.logits for o in outs], dim=0)
    return torch.cat(outs, dim=0)


@torch.no_grad()
def copy_weights(src: nn.Module, dst: nn.Module) -> None:
    """Copy every parameter of `src` into `dst`'s mesh and layout: one redistribute per parameter.

    `dst` is the same architecture, already laid out (e.g. by `parallelize_module`) on its own mesh.
    """
    dst_params = dict(dst.named_parameters())
    for name, p in src.named_parameters():
        if name not in dst_params:
            raise KeyError(f"copy_weights: {name!r} is not a parameter of the destination module")
        q = dst_params[name]
        if not isinstance(p, DTensor) or not isinstance(q, DTensor):
            raise TypeError(f"copy_weights: {name!r} must be a DTensor on both sides")
        moved = p.detach().redistribute(device_mesh=q.device_mesh, placements=q.placements)
        owner, _, leaf = name.rpartition(".")
        _set_param(dst.get_submodule(owner) if owner else dst, leaf, moved, q.requires_grad)


@contextlib.contextmanager
def loss_parallel() -> Any:
    """torch's `loss_parallel()`, for code written for it: with DTorch, a loss over logits whose class dim is sharded
    (a `ColwiseParallel` head whose output stays `Shard(-1)`) is always computed in parallel, inside this block or
    not: one maximum, one sum and one picked value reduced per row, never the logits gathered (dtorch._softmax,
    dtorch._losses rule 4)."""
    yield
