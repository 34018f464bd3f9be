"""Parallel styles: plans are data (names and meaning as in `torch.distributed.tensor.parallel`).

Layouts name the placement on the tensor-parallel mesh dim; every other mesh dim keeps the
input's placement (activations) or is Replicate (parameters), which is how DP x TP composes.
One difference from torch by design: module code always sees global shapes, so
`use_local_output` is accepted for compatibility and ignored; model code needs no edits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dtorch._spec import from_torch_placement
from dtorch_protocol.placement_types import Placement, Replicate, Shard


@dataclass(frozen=True)
class ParallelStyle:
    """Base: how to lay out a module's parameters and move its inputs and outputs."""

    def prepare(self, module: Any, name: str, mesh: Any, mesh_dim: int) -> None:
        """Check the module (raise one line naming it) and add what the style needs beyond layouts."""

    def param_placements(self, module: Any, name: str) -> Placement | None:
        """Placement of parameter `name` on the TP mesh dim (None: Replicate)."""
        return None

    def input_layouts_for(self, module: Any) -> tuple[Any, Any]:
        """(given input layouts, desired input layouts) for positional inputs, or (None, None)."""
        return None, None

    def output_layouts_for(self, module: Any) -> Any:
        """Desired layout(s) of the output on the TP mesh dim, or None to leave it."""
        return None


def _linear_or_embedding(module: Any, style: ParallelStyle, name: str) -> None:
    import torch.nn as nn

    if not isinstance(module, (nn.Linear, nn.Embedding)):
        raise NotImplementedError(f"{type(style).__name__} supports nn.Linear and nn.Embedding, got "
                                  f"{type(module).__name__} ({name!r})")


@dataclass(frozen=True)
class ColwiseParallel(ParallelStyle):
    """Shard a Linear's output features (weight Shard(0)) or an Embedding's embedding dim (weight Shard(1))."""

    input_layouts: Placement = Replicate()
    output_layouts: Placement = Shard(-1)
    use_local_output: bool = True

    def prepare(self, module: Any, name: str, mesh: Any, mesh_dim: int) -> None:
        _linear_or_embedding(module, self, name)  # a module without parameters too (torch refuses it)

    def param_placements(self, module: Any, name: str) -> Placement | None:
        import torch.nn as nn

        if isinstance(module, nn.Embedding):
            return Shard(1)
        return Shard(0)

    def input_layouts_for(self, module: Any) -> tuple[Any, Any]:
        return (self.input_layouts,), (Replicate(),)

    def output_layouts_for(self, module: Any) -> Any:
        return self.output_layouts


@dataclass(frozen=True)
class RowwiseParallel(ParallelStyle):
    """Shard a Linear's input features (weight Shard(1), bias replicated) or an Embedding's rows (Shard(0))."""

    input_layouts: Placement = Shard(-1)
    output_layouts: Placement = Replicate()
    use_local_output: bool = True

    def prepare(self, module: Any, name: str, mesh: Any, mesh_dim: int) -> None:
        _linear_or_embedding(module, self, name)  # a module without parameters too (torch refuses it)

    def param_placements(self, module: Any, name: str) -> Placement | None:
        import torch.nn as nn

        if isinstance(module, nn.Embedding):
            return Shard(0)
        return Shard(1) if name == "weight" else None

    def input_layouts_for(self, module: Any) -> tuple[Any, Any]:
        import torch.nn as nn

        desired = Replicate() if isinstance(module, nn.Embedding) else Shard(-1)
        return (self.input_layouts,), (desired,)

    def output_layouts_for(self, module: Any) -> Any:
        return self.output_layouts


@dataclass(frozen=True)
class SequenceParallel(ParallelStyle):
    """Norms and dropout on sequence-sharded activations: parameters replicated, activations Shard(1)."""

    sequence_dim: int = 1
    use_local_output: bool = False

    def input_layouts_for(self, module: Any) -> tuple[Any, Any]:
        return (Replicate(),), (Shard(self.sequence_dim),)

    def output_layouts_for(self, module: Any) -> Any:
        return Shard(self.sequence_dim)


@dataclass(frozen=True)
class PrepareModuleInput(ParallelStyle):
    """Redistribute a module's inputs: `input_layouts` say how plain tensors are taken, `desired_*` the target."""

    input_layouts: Any = None
    desired_input_layouts: Any = None
    input_kwarg_layouts: dict[str, Placement] = field(default_factory=dict)
    desired_input_kwarg_layouts: dict[str, Placement] = field(default_factory=dict)
    use_local_output: bool = False

    def input_layouts_for(self, module: Any) -> tuple[Any, Any]:
        return _as_tuple(self.input_layouts), _as_tuple(self.desired_input_layouts)


@dataclass(frozen=True)
class PrepareModuleOutput(ParallelStyle):
    """Redistribute a module's outputs to `desired_output_layouts`."""

    output_layouts: Any = None
    desired_output_layouts: Any = None
    use_local_output: bool = True

    def output_layouts_for(self, module: Any) -> Any:
        return self.desired_output_layouts


@dataclass(frozen=True)
class PrepareModuleInputOutput(PrepareModuleInput):
    """`PrepareModuleInput` and `PrepareModuleOutput` in one style, as torch's."""

    use_local_input: bool = False
    output_layouts: Any = None
    desired_output_layouts: Any = None

    def output_layouts_for(self, module: Any) -> Any:
        return self.desired_output_layouts


def _as_tuple(v: Any) -> Any:
    if v is None:
        return None
    return tuple(v) if isinstance(v, (list, tuple)) else (v,)


@dataclass(frozen=True)
class ExpertParallel(ParallelStyle):
    """Shard a mixture-of-experts module's stacked expert weights on the expert dim (dim 0) over the mesh dim.

    Apply it to the module that holds the experts as `[num_experts, ...]` parameters, e.g. transformers'
    `MixtralExperts` / `Qwen2MoeExperts` (`"model.layers.*.mlp.experts"`). Routing runs unchanged: its grouped
    matmuls compute each device's experts on the rows routed to them (`dtorch._experts`); the tokens are gathered
    once on the mesh dim when they are sharded on it, and the outputs reduced once where the next op needs them.
    """

    def prepare(self, module: Any, name: str, mesh: Any, mesh_dim: int) -> None:
        experts = _expert_count(module, name)
        n, dim_name = mesh.shape[mesh_dim], _dim_name(mesh, mesh_dim)
        if experts % n:
            raise ValueError(f"ExpertParallel: {name!r} has {experts} experts, which mesh dim {dim_name} of size {n} "
                             f"cannot split evenly; use a mesh dim whose size divides {experts}")
        impl = getattr(getattr(module, "config", None), "_experts_implementation", "grouped_mm")
        if impl not in (None, "grouped_mm"):
            raise ValueError(f"ExpertParallel: {name!r} runs transformers' {impl!r} experts, whose per-expert loop "
                             "reads the routing on the client; build the model with "
                             "experts_implementation='grouped_mm' (transformers' default)")
        from dtorch._experts import new_routing_tag, routing_scope

        tag, scopes = new_routing_tag(), []

        def enter(_mod: Any, _args: Any) -> None:
            scope = routing_scope(tag)
            scope.__enter__()
            scopes.append(scope)

        def leave(_mod: Any, _args: Any, _out: Any) -> None:
            if scopes:
                scopes.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)

    def param_placements(self, module: Any, name: str) -> Placement | None:
        p = getattr(module, name)
        return Shard(0) if p.ndim >= 2 and p.shape[0] == _expert_count(module, name) else None


def _dim_name(mesh: Any, dim: int) -> str:
    return repr(mesh.mesh_dim_names[dim]) if mesh.mesh_dim_names else str(dim)


def _expert_count(module: Any, name: str) -> int:
    """The experts a module stacks: its `num_experts`, else the leading size of its 3-d parameters."""
    stacked = {p.shape[0] for p in module.parameters(recurse=False) if p.ndim == 3}
    count = getattr(module, "num_experts", None)
    if not stacked or (isinstance(count, int) and count not in stacked):
        raise ValueError(f"ExpertParallel: {name!r} ({type(module).__name__}) has no stacked expert weights: "
                         "expected parameters of shape [num_experts, out, in] such as transformers' "
                         "MixtralExperts.gate_up_proj; apply it to the experts module, e.g. "
                         "'model.layers.*.mlp.experts'")
    if isinstance(count, int):
        return count
    if len(stacked) != 1:
        raise ValueError(f"ExpertParallel: {name!r} has 3-d parameters of leading sizes {sorted(stacked)}; expected "
                         "one expert count")
    return stacked.pop()


# torch's own styles (`torch.distributed.tensor.parallel.ColwiseParallel()`, as a ported plan names them), by type
# name: the DTorch style with the same fields. torch keeps each layout as a tuple, and its placements are its own.
def _layouts(v: Any) -> Any:
    return tuple(from_torch_placement(p) for p in v) if isinstance(v, tuple) else from_torch_placement(v)


def _one(v: Any) -> Any:
    v = _layouts(v)
    return v[0] if isinstance(v, tuple) and len(v) == 1 else v


def _input(t: Any, **more: Any) -> dict[str, Any]:
    kw = {k: {n: _one(p) for n, p in (getattr(t, k) or {}).items()}
          for k in ("input_kwarg_layouts", "desired_input_kwarg_layouts")}
    return dict(input_layouts=_layouts(t.input_layouts), desired_input_layouts=_layouts(t.desired_input_layouts),
                **kw, **more)


_FROM_TORCH = {
    "ColwiseParallel": lambda t: ColwiseParallel(_one(t.input_layouts), _one(t.output_layouts), t.use_local_output),
    "RowwiseParallel": lambda t: RowwiseParallel(_one(t.input_layouts), _one(t.output_layouts), t.use_local_output),
    "SequenceParallel": lambda t: SequenceParallel(_one(t.sequence_sharding).dim, t.use_local_output),
    "PrepareModuleInput": lambda t: PrepareModuleInput(**_input(t, use_local_output=t.use_local_output)),
    "PrepareModuleOutput": lambda t: PrepareModuleOutput(_layouts(t.output_layouts),
                                                         _layouts(t.desired_output_layouts), t.use_local_output),
    "PrepareModuleInputOutput": lambda t: PrepareModuleInputOutput(
        **_input(t.prepare_module_input, use_local_output=t.prepare_module_output.use_local_output),
        output_layouts=_layouts(t.prepare_module_output.output_layouts),
        desired_output_layouts=_layouts(t.prepare_module_output.desired_output_layouts)),
}


def as_style(style: Any) -> Any:
    """A DTorch style as it is; one of torch's (`torch.distributed.tensor.parallel`) as the DTorch style it names;
    anything else as it is (the caller refuses it)."""
    if isinstance(style, ParallelStyle) or not type(style).__module__.startswith("torch.distributed.tensor.parallel"):
        return style
    convert = _FROM_TORCH.get(type(style).__name__)
    return style if convert is None else convert(style)
