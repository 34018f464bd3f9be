"""Planning: an op and the specs of its DTensor arguments give a plan. Pure: it sends nothing and holds no
DTensor; its only state is a bounded cache of plans.

A plan says which inputs must be redistributed to which layouts, the wire form of the arguments (with slots
{"$t": n} for the n-th DTensor, and per-device variants where args differ by device), and the output specs.
The dispatcher (`_dispatch`) keys the cache on cheap identities of the op's arguments and carries plans out.

Routes, in order of preference:
  sharded   torch's sharding rules (`_sharding.propagate`, which reads DTorch's own rules from `_registry`),
            checked against every device's local shapes (`_sharding.check_local`): a rule that breaks on some
            local shape falls through to replicate
  replicate no rule: gather inputs to Replicate, run everywhere, output Replicate (always correct);
            random ops take this route with a shared seed so values never depend on the plan
  sync      the op returns a Python value (`item`, `is_nonzero`, `equal`): fetch and run locally
  local     the op's output shape depends on the values (torch's fake tensors say so: `nonzero`, `unique`,
            `masked_select`, ...) or workers cannot run it (an op outside aten/prims): a sync point that
            fetches the inputs, runs the op on the client and uploads the outputs as Replicate
  out       an out= op whose out tensors are laid out (or shaped) unlike its outputs, or are plain
            tensors: the functional op runs, then each result is copied into its out tensor
Shapes or dtypes torch's meta kernel refuses raise `Refused` (from `_sharding`), for the caller to report; so does a
quantized dtype among the arguments (DTensors hold unquantized dtypes: `_spec.check_dtype`).

An elementwise op's plan (`numbers_free`: pointwise ops, and `_foreach_` ops but the norm) does not depend on the
values of its float arguments (an optimizer's step size, a learning rate schedule: new every step), only on their
places: the cache keeps it once under its key with
those values left out (`numberless`), and a call with other values takes a copy of it with the new numbers
in its wire arguments (`with_numbers`), unplanned and not kept. Kept per value, such plans would be planned
again every step and push the others out of the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils._pytree as pytree

# rule modules register themselves
from dtorch import (  # noqa: F401
    _amp,
    _arg_reductions,
    _embedding,
    _experts,
    _gather,
    _joint,
    _losses,
    _optimizers,
    _pinned,
    _random_ops,
    _reductions,
    _rules,
    _scans,
    _sequences,
    _sharding,
    _slices,
    _softmax,
    _torch_state,
)
from dtorch._registry import NoRule, Refused, ValueDependent, rule_for
from dtorch._source import src_text
from dtorch._spec import QUANTIZED_DTYPES, QUANTIZED_HINT, Spec
from dtorch._templates import SRC_HOLE, Template, sentinel
from dtorch_protocol import messages as m
from dtorch_protocol.layout import coords
from dtorch_protocol.placement_types import Partial, Replicate
from dtorch_protocol.values import encode_value
from dtorch_protocol.writes import written_arguments

WORKER_NAMESPACES = ("aten", "prims")  # what workers run (dtorch_worker.ops); other ops take the local route
# Why an op runs on the client (the sync and local routes; docs/architecture.md has the table of such ops):
PYTHON_VALUE = "returns a Python value"
VALUE_DEPENDENT = "has output shapes that depend on the values (or no kernel that can tell them without the values)"
NOT_ATEN = "is not an aten/prims op (workers run only those)"
CACHE_SIZE = 8192  # plans kept; the oldest goes first


class MixedMeshes(Exception):
    """DTensors of one op live on different meshes (pipeline stages, roles): the dispatcher moves them first."""


@dataclass
class Plan:
    op_name: str
    route: str  # "sharded" | "replicate" | "sync" | "local" | "out"
    func: Any
    inputs: list[Spec | None]  # per DTensor leaf: layout to redistribute to, None if it stays
    args: list  # wire template: {"$t": leaf index} marks tensor slots
    kwargs: dict
    local: dict[int, list] | None  # device -> [args, kwargs] templates where they differ per device
    outputs: Any  # Spec | None | list/tuple of (Spec | None)
    flat_outputs: list[Spec | None]
    inplace: bool
    random: bool
    mutated: frozenset[int] = frozenset()  # DTensor leaves the op writes in place (schema alias_info.is_write)
    op: Any = None  # the op as dispatched (`func` may be torch's rewrite of it)
    why: str = ""  # sync and local routes: why the op runs on the client (one of the reasons below)
    view: bool = False  # the outputs alias the first input (`_views`: a moved input is then their origin)
    # the common case (no moves, one output, tensor slots only at the top level of args): `encode` turns the
    # record (encode, tid of each DTensor leaf..., output tid, code, offset) into the wire instruction
    encode: Callable[[tuple], Any] | None = None

    def __post_init__(self) -> None:
        simple = (self.route != "sync" and not self.inplace and not self.mutated and not self.random
                  and self.local is None
                  and not any(self.inputs) and not isinstance(self.outputs, (list, tuple))
                  and self.outputs is not None and not _has_slot(self.kwargs))
        slots = [(pos, a["$t"]) for pos, a in enumerate(self.args) if type(a) is dict and "$t" in a]
        if simple and all(not _has_slot(a) for a in self.args if not (type(a) is dict and "$t" in a)):
            self.encode = _fast_encoder(self, slots)


def _fast_encoder(plan: Plan, slots: list[tuple[int, int]]) -> Callable[[tuple], Any]:
    """The encoder of a fast plan's records: its InstrCall as a wire template (`_templates`), filled on the
    sender thread; the message built field by field where the template cannot be cut."""
    out: Spec = plan.outputs
    n = len(slots)
    default_dtype = _torch_state.default_dtype  # the one it was planned under (plans go when it changes)

    def call(tids: Sequence[int], out_tid: int, src: str) -> m.InstrCall:
        args = plan.args.copy()
        for pos, leaf in slots:
            args[pos] = {"$t": tids[leaf]}
        return m.InstrCall(plan.op_name, out.mesh.id, args, plan.kwargs, [m.OutSpec(out_tid, out.wire)], None, src,
                           default_dtype=default_dtype)

    template = Template.of(call([sentinel(i) for i in range(n)], sentinel(n), SRC_HOLE),
                           [*(sentinel(i) for i in range(n)), sentinel(n), SRC_HOLE])
    if template is None:
        return lambda r: call(r[1:n + 1], r[n + 1], src_text(r[n + 2], r[n + 3]))
    fill = template.fill
    return lambda r: fill((*r[1:n + 2], src_text(r[n + 2], r[n + 3])))


def _has_slot(t: Any) -> bool:
    if type(t) is list:
        return any(_has_slot(x) for x in t)
    if type(t) is dict:
        return "$t" in t or any(_has_slot(x) for x in t.values())
    return False


# A shard's strides can differ from the global tensor's (kernels pick their own output layouts), so a view
# that is valid globally may not be locally: workers reshape, which is the same view whenever one exists.
_WIRE_NAME = {torch.ops.aten.view.default: "aten.reshape.default",
              torch.ops.aten._unsafe_view.default: "aten.reshape.default"}


class _Slot(int):
    """Marks where the n-th DTensor of an op's arguments goes."""


def _slot_templates(args: Any, kwargs: dict) -> tuple[list, dict]:
    """Wire form of (args, kwargs) in which the n-th DTensor spec becomes the slot {"$t": n}."""
    counter = iter(range(1 << 30))
    marked = pytree.tree_map(lambda v: _Slot(next(counter)) if isinstance(v, Spec) else v, (list(args), kwargs))

    def enc(v: Any) -> Any:
        if type(v) is _Slot:
            return {"$t": int(v)}
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        if isinstance(v, dict):
            return {k: enc(x) for k, x in v.items()}
        return encode_value(v, lambda t: None)

    return enc(marked[0]), enc(marked[1])


def is_inplace(func: Any) -> bool:
    schema = func._schema
    return bool(schema.returns) and schema.returns[0].alias_info is not None and \
        schema.returns[0].alias_info.is_write and bool(schema.arguments) and \
        schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write


def is_view(func: Any) -> bool:
    """Does `func` return aliases of its input (`select`, `view`, `split`), without writing it?"""
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _written_leaves(func: Any, args: tuple, kwargs: dict) -> frozenset[int]:
    """Indices (in DTensor-leaf order) of the tensors `func` writes: `add_`'s self, `out=`, `_foreach_*_` lists,
    a training batch norm's running statistics."""
    schema = {a.name: a for a in func._schema.arguments}
    positional = func._schema.arguments
    names = {name for _i, name in writes(func, args, kwargs)}
    written, index = set(), 0
    named = [(positional[i] if i < len(positional) else None, v) for i, v in enumerate(args)]
    named += [(schema.get(k), v) for k, v in kwargs.items()]
    for arg, value in named:
        n = sum(isinstance(x, Spec) for x in pytree.tree_leaves(value))
        if arg is not None and arg.name in names:
            written.update(range(index, index + n))
        index += n
    return frozenset(written)


def writes(func: Any, args: tuple | None = None, kwargs: dict | None = None) -> list[tuple[int, str]]:
    """(position, name) of the arguments `func` writes: those its schema marks (self of in-place ops, out=), and
    those it writes unmarked (`dtorch_protocol.writes`) with these args (without args: any it may write)."""
    return written_arguments(str(func), func._schema.arguments, args, kwargs)


_out_names: dict[Any, tuple[str, ...]] = {}


def outs(func: Any) -> tuple[str, ...]:
    """Names of `func`'s out= arguments (kwarg-only in aten schemas)."""
    names = _out_names.get(func)
    if names is None:
        names = _out_names[func] = tuple(a.name for a in func._schema.arguments if a.is_out)
    return names


def functional(func: Any) -> Any:
    """The overload of `func`'s op that takes the same arguments without out= and writes nothing, or None."""
    want = [(a.name, str(a.type)) for a in func._schema.arguments if not a.is_out]
    packet = func.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        args = cand._schema.arguments
        if not any(a.alias_info is not None and a.alias_info.is_write for a in args) and \
                [(a.name, str(a.type)) for a in args] == want:
            return cand
    return None


def out_plan(func: Any, specs: list[Spec], why: str, into_copies: bool = False) -> Plan:
    """The out route: the functional overload, its results copied into the out= tensors; with `into_copies`,
    where there is no such overload (`eye.m_out`, as `nn.init.eye_` calls it), the op itself into Replicate
    copies of its out= tensors, copied into them."""
    run = functional(func) or (func if into_copies else None)
    if run is None:
        raise NotImplementedError(f"dtorch: {func} {why}, and it has no functional overload to run instead, so "
                                  f"it cannot run on DTensors with placements {_placements(specs)}")
    return Plan(str(func), "out", run, [], [], {}, None, None, [], False, False)


def _out_mismatch(func: Any, spec_kwargs: dict, flat_outputs: list) -> bool:
    """Do the out= tensors differ in layout or shape from what the op computes?"""
    targets = [spec_kwargs.get(n) for n in outs(func)]
    if len(targets) != len(flat_outputs):
        return True
    for t, o in zip(targets, flat_outputs):
        if isinstance(t, Spec) and o is not None and (t.placements != o.placements or t.shape != o.shape):
            return True
        if isinstance(t, (list, tuple)):
            return True  # Tensor[] outs: always through the functional op
    return False


def _placements(specs: list[Spec]) -> list:
    return [s.placements for s in specs]


def _local_plan(func: Any, specs: list[Spec], why: str, random: bool) -> Plan:
    if outs(func) and not is_inplace(func):
        return out_plan(func, specs, why)
    if writes(func):
        raise NotImplementedError(f"dtorch: {func} {why} and writes its arguments in place, so it cannot run on "
                                  f"DTensors with placements {_placements(specs)}")
    return Plan(str(func), "local", func, [], [], {}, None, None, [], False, random, why=why)


def _returns_tensors(func: Any) -> bool:
    for r in func._schema.returns:
        text = str(r.type)
        if "Tensor" not in text:
            return False
    return True


def plan(func: Any, spec_args: tuple, spec_kwargs: dict) -> Plan:
    """The plan of `func` on arguments whose DTensors are replaced by their Specs (DTensor leaves in the order
    of `pytree.tree_leaves((args, kwargs))`)."""
    leaves = pytree.tree_leaves((spec_args, spec_kwargs))
    specs = [v for v in leaves if isinstance(v, Spec)]
    if len({s.mesh for s in specs}) > 1:
        raise MixedMeshes
    mesh = specs[0].mesh
    op_name = str(func)
    for v in leaves:  # a quantize op (its meta kernel says float32 for a qint8 result), `.to(torch.qint8)`
        if type(v) is torch.dtype and v in QUANTIZED_DTYPES:
            raise Refused(NotImplementedError(f"quantized dtype {v}; {QUANTIZED_HINT}"))
    inplace = is_inplace(func)
    if not _returns_tensors(func):
        return Plan(op_name, "sync", func, [], [], {}, None, None, [], inplace, False, why=PYTHON_VALUE)
    if inplace and torch.Tag.pointwise in func.tags:
        _sharding.check_inplace_cast(func, spec_args, spec_kwargs)
    # seeded ops run replicated under a shared seed, unless one of our rules covers them (it refuses dropout)
    random = torch.Tag.nondeterministic_seeded in func.tags and rule_for(func) is None
    if func.namespace not in WORKER_NAMESPACES:
        return _local_plan(func, specs, NOT_ATEN, random)
    route, local = "sharded", None
    try:
        if random:
            raise NoRule("random op")
        prop = _sharding.propagate(func, spec_args, spec_kwargs, mesh)
        run_func, new_args, outputs = prop.op, prop.args, prop.outputs
        if _non_sum_partial(outputs) and any(_has_empty_shard(s) for s in specs):
            raise NoRule("max/min/avg over an empty shard")  # torch refuses e.g. max() of nothing
        required = [s for s in pytree.tree_leaves((new_args, prop.kwargs)) if isinstance(s, Spec)]
        _sharding.check_local(func, prop, mesh, spec_args)
        if prop.rank_args is not None:  # devices whose args are alike share one template (filled once an op)
            shared: dict[int, list] = {}
            local = {mesh.devices[rank]: shared.get(id(a)) or shared.setdefault(id(a), list(_slot_templates(a, k)))
                     for rank, (a, k) in enumerate(prop.rank_args)}
    except NoRule:
        route, run_func, new_args = "replicate", func, spec_args
        replicate = (Replicate(),) * mesh.ndim
        required = [s.with_placements(replicate) for s in specs]
        try:
            outputs = _sharding.meta_outputs(func, spec_args, spec_kwargs, mesh)  # Refused: the caller's error
        except NoRule as e:
            raise NotImplementedError(f"dtorch: {func} is not supported on DTensors with placements "
                                      f"{_placements(specs)} ({e})") from None
        except ValueDependent:
            return _local_plan(func, specs, VALUE_DEPENDENT, random)
    inputs = [None if r.placements == s.placements else r for r, s in zip(required, specs)]
    outputs = _masked_outputs(func, spec_args, spec_kwargs, outputs)
    flat_outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    if outs(func) and _out_mismatch(func, spec_kwargs, flat_outputs):
        return out_plan(func, specs, "computes outputs laid out unlike its out= tensors",
                        into_copies=all(isinstance(spec_kwargs.get(n), Spec) for n in outs(func)))
    if not func._schema.returns:  # e.g. _linalg_check_errors: runs for its error only (dispatch returns None)
        outputs, flat_outputs = (), []
    wire_args, wire_kwargs = _slot_templates(new_args, spec_kwargs)
    return Plan(_WIRE_NAME.get(run_func, str(run_func)), route, run_func, inputs, wire_args, wire_kwargs, local,
                outputs, flat_outputs, inplace, random, _written_leaves(func, spec_args, spec_kwargs),
                view=is_view(func))


def _masked_outputs(func: Any, args: tuple, kwargs: dict, outputs: Any) -> Any:
    """A backward op's outputs that its `output_mask` turns off are None: the kernels leave them undefined (the
    input's gradient of a layer whose input needs none), where meta kernels and torch's rules may still describe a
    tensor for them (`native_batch_norm_backward`), which a worker could never store."""
    names = [a.name for a in func._schema.arguments]
    if "output_mask" not in names or not isinstance(outputs, (list, tuple)):
        return outputs
    at = names.index("output_mask")
    mask = args[at] if at < len(args) else kwargs.get("output_mask")
    if mask is None:
        return outputs
    return type(outputs)(o if i >= len(mask) or mask[i] else None for i, o in enumerate(outputs))


def _non_sum_partial(outputs: Any) -> bool:
    flat = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return any(isinstance(p, Partial) and p.reduce_op != "sum" for s in flat if s is not None for p in s.placements)


def _has_empty_shard(spec: Spec) -> bool:
    return any(n == 0 and full > 0 for c in coords(spec.mesh.shape)
               for n, full in zip(_sharding.local_shape(spec, c), spec.shape))


def numberless(key: Any) -> Any:
    """A plan-cache key (`_dispatch.op_key`'s form: a number is `(type, value)`) with each float's value left out."""
    if type(key) is tuple:
        if len(key) == 2 and key[0] is float:
            return (float, None)
        return tuple([numberless(k) for k in key])
    return key


def with_numbers(p: Plan, args: tuple, kwargs: dict) -> Plan | None:
    """`p`, planned for an elementwise op with other float arguments, with those of `args`/`kwargs` (specs in
    place of DTensors); None unless its wire arguments differ from p's in floats only."""
    if p.local is not None:
        return None
    wire_args, wire_kwargs = _slot_templates(args, kwargs)
    if not _same_but_floats([wire_args, wire_kwargs], [p.args, p.kwargs]):
        return None
    return replace(p, args=wire_args, kwargs=wire_kwargs, encode=None)


def _same_but_floats(a: Any, b: Any) -> bool:
    if type(a) is float and type(b) is float:
        return True
    if type(a) is list and type(b) is list:
        return len(a) == len(b) and all(_same_but_floats(x, y) for x, y in zip(a, b))
    if type(a) is dict and type(b) is dict:
        return a.keys() == b.keys() and all(_same_but_floats(v, b[k]) for k, v in a.items())
    return type(a) is type(b) and a == b


# `_foreach_` ops that reduce: their numbers choose the reduction (`_foreach_norm`'s ord: max for inf, a sum of
# powers otherwise), so their plans depend on them
_FOREACH_REDUCTIONS = ("_foreach_norm",)


def numbers_free(func: Any) -> bool:
    """Is `func` elementwise, so that its plan does not depend on the values of its float arguments?"""
    name = func.__name__
    return torch.Tag.pointwise in func.tags or \
        (name.startswith("_foreach_") and not name.startswith(_FOREACH_REDUCTIONS))


class Planner:
    """Plans by key, at most `size` of them (the oldest is dropped first: a dropped plan is simply made again)."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self._plans: dict[Any, Plan] = {}
        self.get: Callable[[Any], Plan | None] = self._plans.get  # the cached plan of a key, or None

    def plan(self, key: Any, func: Any, args: tuple, kwargs: dict) -> Plan:
        """`plan(func, args, kwargs)`, kept under `key` (None: not kept). A key may hold `id(func)`: the plan
        holds `func` (`Plan.op`), so the id cannot go to another object while the key is kept. An elementwise
        op's plan is also kept under its key without float values, for other values (module docstring)."""
        keys = [key]
        if key is not None and numbers_free(func):
            general = numberless(key)
            if general != key:
                kept = self._plans.get(general)
                if kept is not None and (p := with_numbers(kept, args, kwargs)) is not None:
                    return p
                keys.append(general)
        p = plan(func, args, kwargs)
        p.op = func
        plans = self._plans
        for k in keys if key is not None else ():
            if len(plans) >= self.size:
                del plans[next(iter(plans))]
            plans[k] = p
        return p

    def plans(self) -> list[Plan]:
        return list(self._plans.values())

    def clear(self) -> None:
        """Forget every kept plan (the next use of each op plans again)."""
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
