"""`CommDebugMode`: the collectives a block's redistributions are, counted as torch's CommDebugMode counts them.

    with CommDebugMode() as comm_mode:
        model(x).sum().backward()
    comm_mode.get_comm_counts()[torch.ops.c10d_functional.all_reduce]
    comm_mode.comm_module_counts["Transformer.layers.0.attention"]["forward"]
    print(comm_mode.generate_comm_debug_tracing_table(noise_level=1))

Rules:
  1. Every redistribution the client asks for in the block is counted (an op's input laid out anew, an explicit
     `redistribute`, an FSDP gather and its reduce-scatter), from any thread: one per mesh dim of two devices or
     more whose placement changes, keyed by the functional collective torch's DTensor issues for that change (the
     kind of move `placement_types.MOVES` names, the controller's lowering table, then table COLLECTIVES), so a
     torch test's assertions read the same. A change that needs no communication (Replicate -> Shard, to Partial)
     counts nothing; a move between two meshes counts one CROSS_MESH. These are what the program needs, not how
     the data plane moves it: the workers may reduce several Partial dims in one step or take point-to-point
     pieces (docs/architecture.md).
  2. Reads (`to_torch()`, `.item()`) and uploads are transfers between the client and the workers, not
     collectives, and count nothing (torch's DTensor counts its own: `full_tensor()` is an all_gather there, a
     replicated `distribute_tensor` a broadcast), but for a replicated upload of 1 MiB or more, which goes to the
     workers sharded and is gathered there (one all_gather).
  3. The block runs every operation eagerly (`_capture.Eager`): a replayed step sends one instruction for the
     whole step, and would be counted as nothing. A replay runs the same instructions, so the counts are those
     of the captured program.
  4. Modules: each count also goes to every module whose forward or backward is running (the autograd engine
     runs in this thread: "backward"), and to "Global"; the root module is named by its class, the others by their
     path under it (torch's CommDebugMode's names). A module's forward lasts until its own forward hooks have run,
     so a parallel style's output redistribution (RowwiseParallel's reduction) is the module's, as torch counts
     it; its backward from the first gradient of one of its outputs to the gradients of all its inputs that need
     one (or the end of the backward pass). A forward run again inside a backward (activation checkpointing) is
     the backward's.
  5. Nothing of the block outlives it in the program's tensors: its gradient hooks go with it. Kept, a hook on a
     tensor that lives on (an input, a parameter's gradient path) held the mode, and through it every parameter it
     noted, with their shards on the workers.
"""

from __future__ import annotations

import weakref
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_pre_hook

from dtorch import _capture, _sharding, runtime
from dtorch.device_mesh import shape_of
from dtorch.dtensor import DTensor
from dtorch_protocol import messages as m
from dtorch_protocol.placement_types import move, placement_from_wire

_funcol = torch.ops.c10d_functional
# what a change of one mesh dim's placement takes (`placement_types.MOVES`) -> torch's functional collective for it
COLLECTIVES: dict[str, Any] = {
    "all_gather": _funcol.all_gather_into_tensor,
    "all_to_all": _funcol.all_to_all_single,
    "all_reduce": _funcol.all_reduce,
    "reduce_scatter": _funcol.reduce_scatter_tensor,
}
CROSS_MESH = "point_to_point"  # the key of a move between two meshes, which torch's DTensor cannot make


def collectives(src: m.TensorSpec, dst: m.TensorSpec) -> list[Any]:
    """What one redistribution counts (rule 1)."""
    if src.mesh != dst.mesh:
        return [CROSS_MESH]
    return [COLLECTIVES[kind] for n, p, q in zip(shape_of(src.mesh), src.placements, dst.placements)
            if n > 1 and p != q and (kind := move(placement_from_wire(p), placement_from_wire(q))) in COLLECTIVES]


def _needing_grad(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]


class _Modules:
    """Which modules run forward and backward now, by name (rule 4); `on_forward(module, name)` is told of each
    forward."""

    def __init__(self, on_forward: Any) -> None:
        self.on_forward = on_forward
        self.names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self.forward: Counter[str] = Counter()
        self.backward: Counter[str] = Counter()
        self.task: int | None = None  # the backward pass `backward` belongs to
        self.calls: defaultdict[str, list[object]] = defaultdict(list)  # a module's running forwards, innermost last
        # the gradient hooks on the block's tensors: removed with the block (rule 5)
        self.hooks: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> _Modules:
        self.handle = register_module_forward_pre_hook(self._pre)
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()

    def running(self) -> list[str]:
        counter = self.backward if _sharding.in_backward() is not None else self.forward
        return ["Global", *(name for name, n in counter.items() if n > 0)]

    def name(self, module: torch.nn.Module) -> str:
        if module not in self.names:  # a root: its class; every module under it, its path (as torch names them)
            root = self.names[module] = type(module).__name__
            for path, sub in module.named_modules():
                if path:
                    self.names[sub] = f"{root}.{path}"
        return self.names[module]

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if _sharding.in_backward() is not None:
            return
        name = self.name(module)
        self.on_forward(module, name)
        self.forward[name] += 1
        calls, call = self.calls[name], object()
        calls.append(call)

        def ended(_module: Any, _args: Any, out: Any) -> None:  # after the module's own forward hooks
            if not calls or calls[-1] is not call:  # (an inner call of the same module ended)
                return
            calls.pop()
            handle.remove()
            self.forward[name] -= 1
            outputs = _needing_grad(out)
            if outputs:
                self.hooks.append(register_multi_grad_hook(outputs, lambda *_: self._backward_starts(name), mode="any"))

        handle = module.register_forward_hook(ended, always_call=True)
        inputs = _needing_grad(args)
        if inputs:
            self.hooks.append(register_multi_grad_hook(inputs, lambda *_: self._backward_ends(name)))

    def _backward_starts(self, name: str) -> None:
        task = _sharding.in_backward()
        if task != self.task:  # a new backward pass: modules whose inputs needed no gradient ended with the last
            self.task = task
            self.backward.clear()
        self.backward[name] += 1

    def _backward_ends(self, name: str) -> None:
        if self.backward[name] > 0:
            self.backward[name] -= 1


class CommDebugMode:
    """Counts the collectives of the block's redistributions (see the module docstring); read after the block."""

    def __init__(self) -> None:
        self.comm_counts: defaultdict[Any, int] = defaultdict(int)
        self.comm_module_counts: dict[str, dict[str, defaultdict[Any, int]]] = {}
        self.comm_line_counts: defaultdict[tuple[str, Any], int] = defaultdict(int)  # (source line, key) -> count
        self._parameters: dict[str, dict[str, torch.Tensor]] = {}
        self._sharding: dict[str, Any] = {}
        self._session: Any = None

    # ------------------------------------------------------------ the block
    def __enter__(self) -> CommDebugMode:
        self.comm_counts.clear()
        self.comm_module_counts.clear()
        self.comm_line_counts.clear()
        self._parameters.clear()
        self._sharding.clear()
        self._session = s = runtime.get_session()
        self._eager = _capture.Eager(s).__enter__()
        self._modules = _Modules(self._note_parameters).__enter__()
        self._emit, s.emit = s.emit, self._tap
        return self

    def __exit__(self, *exc: object) -> None:
        self._session.emit = self._emit
        self._modules.__exit__(*exc)
        self._eager.__exit__(*exc)

    def _tap(self, instr: Any) -> None:
        if isinstance(instr, m.InstrRedistribute):
            for key in collectives(instr.src_spec, instr.dst_spec):
                self._count(key, instr.src_line)
        self._emit(instr)

    def _count(self, key: Any, line: str) -> None:
        self.comm_counts[key] += 1
        self.comm_line_counts[(line, key)] += 1
        phase = "backward" if _sharding.in_backward() is not None else "forward"
        for name in self._modules.running():
            counts = self.comm_module_counts.setdefault(name, {"forward": defaultdict(int),
                                                               "backward": defaultdict(int)})
            counts[phase][key] += 1

    def _note_parameters(self, module: torch.nn.Module, name: str) -> None:
        for pname, param in module.named_parameters(recurse=False):
            self._parameters.setdefault(name, {})[pname] = param
            if isinstance(param, DTensor):
                self._sharding[f"{name}.{pname}"] = param.placements

    # ------------------------------------------------------------ reading it (torch's names)
    def get_total_counts(self) -> int:
        return sum(self.comm_counts.values())

    def get_comm_counts(self) -> dict[Any, int]:
        """Count per collective, keyed as torch's (`torch.ops.c10d_functional.all_reduce`, ...)."""
        return self.comm_counts

    def get_parameter_info(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per module that ran forward in the block, its own parameters."""
        return self._parameters

    def get_sharding_info(self) -> dict[str, Any]:
        """`"Module.path.param"` -> the placements of each DTensor parameter of the modules that ran forward."""
        return self._sharding

    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        """The counts per module and phase; from noise level 1 the modules' parameters' placements, from 2 the
        source lines that asked for each collective."""
        lines = []
        for name in sorted(self.comm_module_counts, key=lambda n: (n != "Global", n)):
            lines.append(f"{'  ' * name.count('.')}{name}")
            indent = "  " * (name.count(".") + 1)
            if noise_level >= 1:
                lines += [f"{indent}*{pname}: {placements}" for key, placements in self._sharding.items()
                          if key.rpartition(".")[0] == name for pname in [key.rpartition(".")[2]]]
            for phase, counts in self.comm_module_counts[name].items():
                if counts:
                    lines.append(f"{indent}{phase.upper()} PASS")
                    lines += [f"{indent}  *{key}: {n}" for key, n in counts.items()]
        if noise_level >= 2 and self.comm_line_counts:
            lines.append("by source line")
            lines += [f"  {line or '?'}: {key} x{n}" for (line, key), n in self.comm_line_counts.items()]
        return "\n".join(lines)

    def log_comm_debug_tracing_table_to_file(self, file_name: str = "comm_mode_log.txt", noise_level: int = 3) -> None:
        Path(file_name).write_text(self.generate_comm_debug_tracing_table(noise_level) + "\n")

    def __repr__(self) -> str:
        return f"CommDebugMode(get_total_counts()={self.get_total_counts()})"
