"""Op-coverage conformance: PyTorch's own OpInfo database run on DTensors, checked against plain torch.

    python -m dtorch.testing.conformance conformance-report/            # every OpInfo (minutes)
    python -m dtorch.testing.conformance out/ --ops add,cat,index_put    # a few, by OpInfo name

For each OpInfo of `torch.testing._internal.common_methods_invocations.op_db` and each of its
first `max_samples` CPU sample inputs, every tensor among the sample's input/args/kwargs becomes a
DTensor on a 4-device mesh (`DeviceMesh("cpu", [0, 1, 2, 3])`) under a few placement combinations
(all-Replicate first, then up to `max_combos` sharded ones: Shard(d) on dims of size > 1, see
`placement_combos`). The op runs on the DTensors; `to_torch()` of every tensor output is compared
with torch's result on the full tensors.

Rules (the report states them too):
  dtype      float32 when the OpInfo supports it on CPU, else the first of int64, bool, complex64 it supports;
             with `--dtype bfloat16` (or float16) that dtype, and OpInfos without it on CPU are not-supported.
  compare    assert_close with rtol = atol = 1e-4 for float/complex outputs (2e-2 for bfloat16 outputs, 2e-3 for
             float16: rounding apart in another order; equal NaNs), exact for
             integer/bool outputs; shapes and dtypes must match; non-tensor outputs compare with ==
             (floats with the same tolerance); outputs are matched leaf by leaf (pytree order).
  random     samples whose values cannot be compared are checked on shapes and dtypes only, and pass when
             those match: every sample of an OpInfo named in `UNCOMPARABLE` (random sampling, dropout,
             uninitialised memory), and any sample whose torch reference run calls an op tagged
             `nondeterministic_seeded` (e.g. scaled_dot_product_attention with dropout_p > 0). The
             report lists these ops separately.
  seeding    torch.manual_seed(0) before an op's samples are drawn and before every run (DTorch's random ops
             draw their seeds from torch's generator).
  pass       every (sample, placements) case ran and matched.
  fail       some case gave a wrong result or raised anything but a DTorch NotImplementedError
             (the first such error is recorded, one line).
  not-supported
             DTorch refused clearly (a NotImplementedError that names the op, raised by dtorch), or the
             inputs are ones DTorch cannot take (no tensor inputs at all, e.g. factories; sparse or
             quantized tensors; no CPU dtype). A case that fails outranks a refusal.
  Samples on which torch itself raises are skipped; an OpInfo with no usable sample is not-supported.

Options: `--partial` adds one combination per sample, the first float input as Partial("sum");
`--variants` also runs each OpInfo's in-place variant (where the result has self's shape and dtype) and
out= variant (into a DTensor of zeros laid out like the first input, unless Partial, compared with what torch's own
out= variant writes into zeros), on all-Replicate and the first sharded combination; they are reported apart, the
OpInfo's status stays its function variant's.
`--grad` checks gradients too, on every case whose values are compared, of OpInfos that support autograd, in
a floating point dtype: `torch.autograd.grad` of the float outputs (those that need a gradient) with fixed random
cotangents (Replicate DTensors for DTorch) with respect to every float input, compared with torch's as values are (a
gradient torch leaves undefined may be all zeros); a gradient that is a plain tensor, not a DTensor, fails. Reported
apart, as the variants are.
`--errors` runs each OpInfo's error inputs too (the bad arguments torch must refuse: its `error_inputs`), on
all-Replicate and up to `max_combos` sharded combinations: every one torch raises on here must raise on DTensors,
at the call or at the next sync point (the outputs' `full_tensor()`, then `dtorch.synchronize()`); one that gives a
value instead fails (a rule that masks, draws or moves values may skip a check torch's kernel makes). Reported apart.

The module imports no cluster; `run()` takes a mesh. The CLI (`main`) starts ONE embedded cluster
(`dtorch.connect(workers=2)`) for the whole run and reconnects only if the cluster breaks.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

RTOL = ATOL = 1e-4  # one number: rtol = atol, for float outputs as for their half-precision ones below
HALF_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = (torch.float32, torch.int64, torch.bool, torch.complex64)

# OpInfo names whose values are random or uninitialised: compared on shapes and dtypes only.
UNCOMPARABLE = re.compile(
    r"^(cauchy|exponential|geometric|log_normal|normal(\..*)?|uniform|bernoulli|multinomial|"
    r"rand(n|int)?(_like)?|empty(_like|_strided|_permuted)?|new_empty(_strided)?|"
    r"nn\.functional\.(rrelu|dropout\d?d?|alpha_dropout|feature_alpha_dropout\.with_train|"
    r"fractional_max_pool\dd))$")

# A fast, representative subset (run by integration/test_conformance_subset.py inside `nox -s tests`).
SUBSET = (
    # elementwise, integer and boolean dtypes included
    "abs", "add", "mul", "div.no_rounding_mode", "where", "clamp", "pow", "sigmoid", "eq", "bitwise_and",
    # reductions (Partial outputs, empty shards)
    "sum", "mean", "amax", "var", "softmax", "cumsum", "argmax",
    # matmul family (matmul of a vector runs squeeze_ in place)
    "matmul", "mm", "bmm", "addmm", "nn.functional.linear",
    # views and shape ops (expand_as gives stride-0 shards; squeeze_copy breaks torch's rule on some shards)
    "view", "reshape", "permute", "transpose", "squeeze", "expand_as", "flatten", "squeeze_copy",
    # joining, splitting, indexing (index_put takes Tensor?[])
    "cat", "stack", "split", "chunk", "index_select", "gather", "masked_fill", "index_put",
    # norms, fft (empty shards), linalg (an op with no returns), data-dependent shapes (the local route)
    "nn.functional.layer_norm", "nn.functional.batch_norm", "fft.fft", "linalg.inv", "histc", "nonzero", "unique",
    # Python values
    "item",
)


@dataclass
class OpResult:
    name: str  # OpInfo name, ".variant" appended when the OpInfo has a variant_test_name
    status: str  # "pass" | "fail" | "not-supported"
    error: str = ""  # first failure (or refusal), one line
    dtype: str = ""
    cases: int = 0  # (sample, placements) runs
    passed: int = 0
    values_checked: bool = True  # False for UNCOMPARABLE ops (shapes and dtypes only)
    seconds: float = 0.0
    failing_case: str = ""  # which sample/placements gave `error`
    inplace: str = ""  # with --variants: "pass", or "fail: <error>" / "not-supported: <error>"; "" = not run
    out: str = ""  # with --variants: the out= variant, likewise
    grad: str = ""  # with --grad: the gradients, likewise
    errors: str = ""  # with --errors: its error inputs, likewise ("" = none torch raises on here)


@dataclass
class _Outcome:
    status: str
    error: str = ""


class _Mismatch(AssertionError):
    pass


class _Unsupported(Exception):
    """The inputs are ones DTorch cannot take (the case is not-supported, not a failure)."""


class _RandomProbe(TorchDispatchMode):
    """Notes whether the reference run calls a random op (torch.Tag.nondeterministic_seeded)."""

    def __init__(self) -> None:
        super().__init__()
        self.random = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random = True
        return func(*args, **(kwargs or {}))


# The op runs from a frame whose file is outside dtorch and torch, so DTorch's error reports name a source
# line ("<conformance>:1") and op errors surface as RemoteOpError naming the op.
def _call(op: Any, a: tuple) -> Any:
    return op(a[0], *a[1], **a[2])


_call.__code__ = _call.__code__.replace(co_filename="<conformance>")


def op_key(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def load_op_db() -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    return list(op_db)


def select_ops(names: Iterable[str] | None = None) -> list:
    ops = load_op_db()
    if names is None:
        return ops
    by_key = {op_key(op): op for op in ops}
    missing = [n for n in names if n not in by_key]
    if missing:
        raise KeyError(f"no OpInfo named {missing} (names are OpInfo.name plus '.variant_test_name')")
    return [by_key[n] for n in names]


def one_line(e: BaseException, limit: int = 300) -> str:
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    msg = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return msg if len(msg) <= limit else msg[:limit - 3] + "..."


def pick_dtype(op: Any, want: torch.dtype = torch.float32) -> torch.dtype | None:
    supported = op.supported_dtypes("cpu")
    if want != torch.float32:
        return want if want in supported else None
    return next((d for d in DTYPES if d in supported), None)


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(tree) if isinstance(v, torch.Tensor)]


def _shard_dims(t: torch.Tensor) -> list[int]:
    return [d for d, n in enumerate(t.shape) if n > 1]


def placement_combos(shapes: Sequence[torch.Size], max_combos: int = 3, partial_at: int | None = None,
                     ) -> list[tuple]:
    """Placement combinations for a sample's tensors (1-d mesh: one placement per tensor).

    All-Replicate first; then, deduplicated, at most `max_combos` of: the first tensor sharded on its
    first shardable dim (others Replicate), every tensor sharded on its first shardable dim, the first
    tensor on its last shardable dim, every tensor on its last shardable dim. A dim is shardable when
    its size is > 1 (sizes below the mesh size give empty shards, which is part of the test).
    With `partial_at` (the `--partial` option), one more: that tensor as Partial("sum"), others Replicate.
    """
    from dtorch_protocol.placement_types import Partial, Replicate, Shard

    dims = [[d for d, n in enumerate(s) if n > 1] for s in shapes]
    rep = tuple(Replicate() for _ in shapes)
    combos = [rep]

    def sharded(which: str, pick: int) -> tuple:
        out = []
        for i, ds in enumerate(dims):
            if ds and (which == "all" or i == 0):
                out.append(Shard(ds[pick]))
            else:
                out.append(Replicate())
        return tuple(out)

    for which, pick in (("first", 0), ("all", 0), ("first", -1), ("all", -1)):
        c = sharded(which, pick)
        if c not in combos:
            combos.append(c)
    combos = combos[:1 + max_combos]
    if partial_at is not None:
        combos.append(tuple(Partial() if i == partial_at else Replicate() for i in range(len(shapes))))
    return combos


def _clone(tree: Any) -> Any:
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, tree)


def _is_close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL) or a == b
    return a == b


def compare(got: Any, expected: Any, values: bool = True) -> None:
    """Raise _Mismatch unless `got` (DTorch's result) matches `expected` (torch's), leaf by leaf."""
    from dtorch.dtensor import DTensor

    g_leaves, e_leaves = pytree.tree_leaves(got), pytree.tree_leaves(expected)
    if len(g_leaves) != len(e_leaves):
        raise _Mismatch(f"{len(g_leaves)} outputs, torch gives {len(e_leaves)}")
    for i, (g, e) in enumerate(zip(g_leaves, e_leaves)):
        if isinstance(e, torch.Tensor):
            if isinstance(g, DTensor):
                g = g.to_torch()
            elif not isinstance(g, torch.Tensor):
                raise _Mismatch(f"output {i} is a {type(g).__name__}, torch gives a tensor")
            if tuple(g.shape) != tuple(e.shape) or g.dtype != e.dtype:
                raise _Mismatch(f"output {i} is {g.dtype}{list(g.shape)}, torch gives {e.dtype}{list(e.shape)}")
            if not values:
                continue
            if e.layout != torch.strided:
                e = e.to_dense()
            tol = HALF_TOLERANCE.get(e.dtype, RTOL) if (e.is_floating_point() or e.is_complex()) else 0.0
            try:
                torch.testing.assert_close(g, e, rtol=tol, atol=tol, equal_nan=True, check_device=False,
                                           check_stride=False, check_layout=False)
            except AssertionError as err:
                lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
                raise _Mismatch(f"output {i}: " + "; ".join(lines[:3])) from None
        elif values and not _is_close(g, e):
            raise _Mismatch(f"output {i} is {g!r}, torch gives {e!r}")


def _refusal(e: BaseException) -> bool:
    """A clear DTorch refusal: a NotImplementedError raised by dtorch that names the op."""
    return isinstance(e, NotImplementedError) and "dtorch" in str(e)


def _outcome(e: BaseException, wrong: str) -> _Outcome:
    """A case's outcome from what it raised: inputs DTorch cannot take and DTorch's refusals are not-supported; a
    mismatch (`wrong`: what was wrong) or any other error fails."""
    if isinstance(e, _Unsupported):
        return _Outcome("not-supported", str(e))
    if isinstance(e, _Mismatch):
        return _Outcome("fail", f"{wrong}: {e}")
    return _Outcome("not-supported" if _refusal(e) else "fail", one_line(e))


def _distribute(tree: Any, placements: Iterable, mesh: Any) -> Any:
    import dtorch

    it = iter(placements)

    def dist(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        p = next(it)
        if v.layout != torch.strided or v.is_quantized or v.is_nested:
            raise _Unsupported(f"{v.layout} input")
        try:
            return dtorch.distribute_tensor(v, mesh, [p])
        except Exception as e:  # noqa: BLE001 (an input DTorch cannot take)
            raise _Unsupported(f"cannot distribute a {v.dtype} input: {one_line(e)}") from None

    return pytree.tree_map(dist, tree)


def _describe_case(index: int, sample: Any, combo: tuple) -> str:
    shapes = [list(t.shape) for t in _tensor_leaves((sample.input, sample.args, sample.kwargs))]
    return f"sample {index} shapes {shapes} placements {list(combo)}"


def run_case(op: Any, sample: Any, expected: Any, combo: tuple, mesh: Any, values: bool) -> _Outcome:
    got = inputs = None
    try:
        torch.manual_seed(0)
        inputs = _distribute(_clone((sample.input, sample.args, sample.kwargs)), combo, mesh)
        got = _call(op, inputs)
        compare(got, expected, values)
        return _Outcome("pass")
    except Exception as e:  # noqa: BLE001 (anything else is the op's outcome)
        return _outcome(e, "wrong result")
    finally:
        del got, inputs


def run_variant(op: Any, kind: str, sample: Any, expected: torch.Tensor, combo: tuple, mesh: Any) -> _Outcome:
    """The in-place variant (`kind="inplace"`: self must end up equal to torch's out-of-place result, and be
    returned) or the out= variant (`kind="out"`: a DTensor of zeros laid out like the first input, where it
    has that shape, else Replicate, must end up equal to it)."""
    import dtorch

    inputs = target = got = None
    try:
        torch.manual_seed(0)
        inputs = _distribute(_clone((sample.input, sample.args, sample.kwargs)), combo, mesh)
        if kind == "inplace":
            target = inputs[0]
            got = _call(op.inplace_variant, inputs)
        else:
            from dtorch_protocol.placement_types import Replicate

            like = inputs[0] if isinstance(inputs[0], torch.Tensor) and inputs[0].shape == expected.shape else None
            placements = like.placements if like is not None and not any(p.is_partial() for p in like.placements) \
                else [Replicate()]
            target = dtorch.distribute_tensor(torch.zeros_like(expected), mesh, placements)
            got = _call(op, (inputs[0], inputs[1], {**inputs[2], "out": target}))
        compare(target, expected)
        if got is not target:
            return _Outcome("fail", f"wrong result: the {kind} variant returned a new tensor, not its target")
        return _Outcome("pass")
    except Exception as e:  # noqa: BLE001
        return _outcome(e, "wrong result")
    finally:
        del inputs, target, got


def _differentiable(tree: Any) -> list[torch.Tensor]:
    return [t for t in _tensor_leaves(tree) if t.is_floating_point()]


def torch_grads(op: Any, sample: Any) -> tuple[list, list] | None:
    """(cotangents, gradients) of torch's run of a sample (--grad), or None when no output needs a gradient."""
    inputs = _clone((sample.input, sample.args, sample.kwargs))
    leaves = _differentiable(inputs)
    for t in leaves:
        t.requires_grad_()
    torch.manual_seed(0)
    outs = [o for o in _differentiable(_call(op, inputs)) if o.requires_grad]
    if not outs:
        return None
    gen = torch.Generator().manual_seed(0)
    cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    return cotangents, list(torch.autograd.grad(outs, leaves, cotangents, allow_unused=True))


def run_grad_case(op: Any, sample: Any, combo: tuple, mesh: Any, cotangents: list, want: list) -> _Outcome:
    """The gradients of one (sample, placements) case against torch's (--grad)."""
    import dtorch
    from dtorch.dtensor import DTensor
    from dtorch_protocol.placement_types import Replicate

    inputs = outs = grads = None
    try:
        inputs = _distribute(_clone((sample.input, sample.args, sample.kwargs)), combo, mesh)
        leaves = _differentiable(inputs)
        for t in leaves:
            t.requires_grad_()
        torch.manual_seed(0)
        outs = [o for o in _differentiable(_call(op, inputs)) if o.requires_grad]
        if len(outs) != len(cotangents):
            raise _Mismatch(f"{len(outs)} outputs need a gradient, torch's {len(cotangents)}")
        grads = torch.autograd.grad(outs, leaves, [dtorch.distribute_tensor(c, mesh, [Replicate()] * mesh.ndim)
                                                   for c in cotangents], allow_unused=True)
        for i, (g, w) in enumerate(zip(grads, want)):
            if g is not None and not isinstance(g, DTensor):
                raise _Mismatch(f"gradient {i} is a plain {type(g).__name__}, not a DTensor")
            if g is None or w is None:
                other = w if g is None else g.to_torch()
                if other is not None and bool(other.count_nonzero()):
                    raise _Mismatch(f"gradient {i} is {'None' if g is None else 'not None'}, torch's is not")
                continue
            compare(g, w)
        return _Outcome("pass")
    except Exception as e:  # noqa: BLE001
        return _outcome(e, "wrong gradient")
    finally:
        del inputs, outs, grads


def _record(res: OpResult, kind: str, out: _Outcome, combo: tuple) -> None:
    """Keep the worst outcome of a variant (`kind`: inplace, out or grad) over its cases."""
    before = getattr(res, kind)
    if out.status == "pass":
        setattr(res, kind, before or "pass")
    elif not before.startswith("fail") and not (out.status == "not-supported" and before.startswith("not")):
        setattr(res, kind, f"{out.status}: {out.error} ({list(combo)})")


def _grads(op: Any, sample: Any, combos: list[tuple], mesh: Any, res: OpResult) -> None:
    """--grad: every combination's gradients against torch's."""
    try:
        reference = torch_grads(op, sample)
    except Exception:  # noqa: BLE001 (torch cannot differentiate this sample)
        return
    if reference is None:
        return
    for combo in combos:
        _record(res, "grad", run_grad_case(op, sample, combo, mesh, *reference), combo)


def _variants(op: Any, sample: Any, expected: Any, combos: list[tuple], mesh: Any, res: OpResult) -> None:
    """--variants: the in-place and out= variants on all-Replicate and the first sharded combination."""
    if not isinstance(expected, torch.Tensor) or expected.layout != torch.strided:
        return
    kinds = []
    if op.inplace_variant is not None and isinstance(sample.input, torch.Tensor) and \
            sample.input.shape == expected.shape and sample.input.dtype == expected.dtype:
        kinds.append("inplace")
    if op.supports_out and (torch_out := _torch_out(op, sample, expected)) is not None:
        kinds.append("out")
    for kind in kinds:
        for combo in combos[:2]:
            want = torch_out if kind == "out" else expected
            _record(res, kind, run_variant(op, kind, sample, want, combo, mesh), combo)


def _torch_out(op: Any, sample: Any, expected: torch.Tensor) -> torch.Tensor | None:
    """What torch's own out= variant writes into zeros shaped like `expected` (the reference of DTorch's: it can
    differ from the function's result, as `fft.ihfftn(out=)` over one dim does in torch 2.13), or None where torch
    refuses it."""
    target = torch.zeros_like(expected)
    try:
        torch.manual_seed(0)
        _call(op, (_clone(sample.input), _clone(sample.args), {**_clone(sample.kwargs), "out": target}))
    except Exception:  # noqa: BLE001 - nothing to compare with
        return None
    return target


def run_error_case(op: Any, case: Any, combo: tuple, mesh: Any) -> _Outcome:
    """One error input under one placement combination (--errors): it must raise, at the call or the next sync."""
    import dtorch

    sample = case.sample_input
    try:
        inputs = _distribute((_clone(sample.input), _clone(sample.args), _clone(sample.kwargs)), combo, mesh)
    except _Unsupported as e:
        return _Outcome("not-supported", str(e))
    try:
        got = op(inputs[0], *inputs[1], **inputs[2])
        for t in _tensor_leaves(got):
            if isinstance(t, dtorch.DTensor):
                t.full_tensor()
        dtorch.synchronize()
    except Exception:  # noqa: BLE001 - refused, as torch refuses it
        return _Outcome("pass")
    return _Outcome("fail", f"gave a value where torch raises ({case.error_regex[:80]!r})")


def _errors(op: Any, mesh: Any, max_combos: int, res: OpResult) -> None:
    """--errors: every error input torch raises on here, on all-Replicate and sharded combinations."""
    try:
        cases = list(op.error_inputs(torch.device("cpu")))
    except Exception:  # noqa: BLE001 (the OpInfo has none, or cannot make them here)
        return
    for case in cases:
        sample = case.sample_input
        leaves = _tensor_leaves((sample.input, sample.args, sample.kwargs))
        if not leaves:
            continue
        try:
            op(*_clone((sample.input, *sample.args)), **_clone(sample.kwargs))
            continue  # torch does not raise on it here (a check of another device's)
        except Exception:  # noqa: BLE001 - torch refuses it: so must DTorch
            pass
        for combo in placement_combos([t.shape for t in leaves], max_combos):
            out = run_error_case(op, case, combo, mesh)
            if out.status != "not-supported":
                _record(res, "errors", out, combo)


def run_op(op: Any, mesh: Any, max_samples: int = 3, max_combos: int = 3, partial: bool = False,
           variants: bool = False, grad: bool = False, want: torch.dtype = torch.float32,
           errors: bool = False) -> OpResult:
    """Every case of one OpInfo; see the module docstring for the rules."""
    start = time.perf_counter()
    name = op_key(op)
    res = OpResult(name, "pass", values_checked=not UNCOMPARABLE.match(name))
    if errors:
        _errors(op, mesh, max_combos, res)
    dtype = pick_dtype(op, want)
    if dtype is None:
        res.status, res.error = "not-supported", (f"no CPU {str(want).removeprefix('torch.')}" if want != torch.float32
                                                  else "no CPU dtype among float32, int64, bool, complex64")
        return res
    res.dtype = str(dtype).removeprefix("torch.")
    refusal = ""
    usable = 0
    try:
        torch.manual_seed(0)
        samples = list(itertools.islice(op.sample_inputs("cpu", dtype), max_samples))
    except Exception as e:  # noqa: BLE001
        res.status, res.error = "not-supported", f"OpInfo gives no samples: {one_line(e)}"
        return res
    for index, sample in enumerate(samples):
        leaves = _tensor_leaves((sample.input, sample.args, sample.kwargs))
        if not leaves:
            refusal = refusal or "no tensor inputs (nothing to distribute)"
            continue
        probe = _RandomProbe()
        try:
            torch.manual_seed(0)
            with probe:
                expected = op(*_clone((sample.input, *sample.args)), **_clone(sample.kwargs))
        except Exception:  # noqa: BLE001 (torch refuses this sample itself)
            continue
        usable += 1
        if probe.random:
            res.values_checked = False
        values = not probe.random and not UNCOMPARABLE.match(name)
        partial_at = next((i for i, t in enumerate(leaves) if t.is_floating_point() and t.numel()), None) \
            if partial else None
        combos = placement_combos([t.shape for t in leaves], max_combos, partial_at)
        if variants and values:
            _variants(op, sample, expected, combos, mesh, res)
        if grad and values and op.supports_autograd and dtype.is_floating_point:
            _grads(op, sample, combos, mesh, res)
        for combo in combos:
            out = run_case(op, sample, expected, combo, mesh, values)
            res.cases += 1
            if out.status == "pass":
                res.passed += 1
            elif out.status == "fail":
                if res.status != "fail":
                    res.status, res.error = "fail", out.error
                    res.failing_case = _describe_case(index, sample, combo)
            elif not refusal:
                refusal = out.error
                res.failing_case = res.failing_case or _describe_case(index, sample, combo)
        del expected
    if res.status != "fail" and refusal:
        res.status, res.error = "not-supported", refusal
    elif res.status == "pass" and usable == 0:
        res.status, res.error = "not-supported", "torch raises on every sample"
    res.seconds = round(time.perf_counter() - start, 3)
    return res


def _cluster_broken(res: OpResult, mesh: Any) -> bool:
    """After a failure that may be the cluster's: is the cluster still answering?"""
    import dtorch

    if res.status != "fail" or not any(w in res.error for w in ("ClusterError", "TimeoutError", "lost", "Broken")):
        return False
    try:
        return dtorch.ones(2, device_mesh=mesh).to_torch().tolist() != [1.0, 1.0]
    except Exception:  # noqa: BLE001
        return True


def run(ops: Sequence, mesh: Any, max_samples: int = 3, max_combos: int = 3, reconnect: Any = None,
        progress: Any = None, partial: bool = False, variants: bool = False, grad: bool = False,
        want: torch.dtype = torch.float32, errors: bool = False) -> list[OpResult]:
    """Run `ops` on `mesh`; `reconnect()` (optional) returns a fresh mesh after the cluster broke."""
    results = []
    for i, op in enumerate(ops):
        res = run_op(op, mesh, max_samples, max_combos, partial, variants, grad, want, errors)
        results.append(res)
        if progress is not None:
            progress(i, len(ops), res)
        if i % 20 == 19:
            gc.collect()
        if reconnect is not None and _cluster_broken(res, mesh):
            mesh = reconnect()
    return results


def summarize(results: Sequence[OpResult]) -> dict[str, int]:
    counts = {"pass": 0, "fail": 0, "not-supported": 0}
    for r in results:
        counts[r.status] += 1
    counts["total"] = len(results)
    return counts


def cause(error: str) -> str:
    """A failure's first error, normalized for grouping: the innermost 'XxxError: ...', digits as N, short."""
    hits = list(re.finditer(r"\b\w+(Error|Exception|Mismatch)\b: ", error))
    text = error[hits[-1].start():] if hits else error.split(";")[0]
    return re.sub(r"\d+", "N", text)[:90]


def causes(results: Sequence[OpResult], top: int = 15) -> list[tuple[str, int]]:
    """The most common normalized first errors among failing ops."""
    bucket: dict[str, int] = {}
    for r in results:
        if r.status == "fail":
            key = cause(r.error)
            bucket[key] = bucket.get(key, 0) + 1
    return sorted(bucket.items(), key=lambda kv: -kv[1])[:top]


def write_report(results: Sequence[OpResult], out_dir: str, meta: dict) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    counts = summarize(results)
    json_path, md_path = os.path.join(out_dir, "conformance.json"), os.path.join(out_dir, "conformance.md")
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "counts": counts, "ops": [asdict(r) for r in results]}, f, indent=1)
    lines = [
        "# DTorch op conformance (PyTorch OpInfo database)", "",
        f"torch {torch.__version__}; mesh of {meta.get('mesh_devices')} logical devices on "
        f"{meta.get('workers')} workers; up to {meta.get('max_samples')} samples per op, all-Replicate plus up "
        f"to {meta.get('max_combos')} sharded placement combinations per sample; {meta.get('seconds')} s.", "",
        "| status | OpInfos |", "|---|---|",
        *[f"| {k} | {counts[k]} |" for k in ("pass", "fail", "not-supported", "total")], "",
        f"Rules: see the docstring of `dtorch.testing.conformance` ({meta.get('dtype', 'float32')} samples; "
        "rtol = atol = 1e-4 (2e-2 bfloat16, 2e-3 float16), exact for integer/bool; random ops compared on shapes",
        "and dtypes only; a DTorch NotImplementedError is not-supported, any other error or a wrong result is a",
        "failure).", "",
    ]
    top = causes(results)
    if top:
        lines += ["## Most common failure causes", "", "| first error (normalized) | ops |", "|---|---|"]
        lines += [f"| `{k}` | {n} |" for k, n in top] + [""]
    for status in ("fail", "not-supported"):
        chosen = [r for r in results if r.status == status]
        if chosen:
            lines += [f"## {status} ({len(chosen)})", "", "| OpInfo | first error | case |", "|---|---|---|"]
            lines += [f"| `{r.name}` | {_md(r.error)} | {_md(r.failing_case)} |" for r in chosen] + [""]
    for kind in ("inplace", "out", "grad", "errors"):
        ran = [r for r in results if getattr(r, kind)]
        if ran:
            bad = [r for r in ran if not getattr(r, kind).startswith("pass")]
            title = {"grad": "gradients", "errors": "error inputs (raise as in torch)"}.get(kind, f"{kind} variants")
            lines += [f"## {title}: {len(ran) - len(bad)} of {len(ran)} pass", ""]
            if bad:
                lines += ["| OpInfo | first error |", "|---|---|"]
                lines += [f"| `{r.name}` | {_md(getattr(r, kind))} |" for r in bad] + [""]
    unchecked = [r.name for r in results if not r.values_checked and r.status == "pass"]
    if unchecked:
        lines += ["## Passing on shapes and dtypes only (random or uninitialised values)", "",
                  ", ".join(f"`{n}`" for n in unchecked), ""]
    with open(md_path, "w") as f:
        f.write("\n".join(lines))
    return json_path, md_path


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtorch.testing.conformance", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", help="where conformance.json and conformance.md go")
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all); 'subset' for SUBSET")
    parser.add_argument("--max-samples", type=int, default=3)
    parser.add_argument("--max-combos", type=int, default=3, help="sharded placement combinations per sample")
    parser.add_argument("--partial", action="store_true",
                        help="one more combination per sample: the first float input as Partial('sum')")
    parser.add_argument("--variants", action="store_true",
                        help="also the in-place and out= variants (reported apart; the status is the function's)")
    parser.add_argument("--grad", action="store_true",
                        help="also the gradients of every float input (reported apart, as the variants)")
    parser.add_argument("--errors", action="store_true",
                        help="also each OpInfo's error inputs: they must raise as in torch (reported apart)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="the samples' floating point dtype (bfloat16, float16: only OpInfos that support it)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("DTORCH_TIMEOUT", "60")  # one hung op must not stall the whole run for long

    import dtorch

    names = None
    if args.ops == "subset":
        names = list(SUBSET)
    elif args.ops:
        names = [n.strip() for n in args.ops.split(",") if n.strip()]
    ops = select_ops(names)

    def connect() -> Any:
        dtorch.connect(workers=args.workers)
        return dtorch.DeviceMesh("cpu", [0, 1, 2, 3])

    def progress(i: int, n: int, res: OpResult) -> None:
        if not args.quiet:
            err = f"  {res.error[:150]}" if res.status != "pass" else ""
            for kind in ("inplace", "out", "grad", "errors"):
                if getattr(res, kind) and not getattr(res, kind).startswith("pass"):
                    err += f"  [{kind}: {getattr(res, kind)[:150]}]"
            print(f"[{i + 1}/{n}] {res.name}: {res.status} ({res.passed}/{res.cases}, {res.seconds:.1f}s){err}",
                  flush=True)

    start = time.perf_counter()
    mesh = connect()
    try:
        results = run(ops, mesh, args.max_samples, args.max_combos, reconnect=connect, progress=progress,
                      partial=args.partial, variants=args.variants, grad=args.grad, want=getattr(torch, args.dtype),
                      errors=args.errors)
    finally:
        dtorch.shutdown()
    seconds = round(time.perf_counter() - start, 1)
    meta = {"torch": torch.__version__, "workers": args.workers, "mesh_devices": 4, "max_samples": args.max_samples,
            "max_combos": args.max_combos, "partial": args.partial, "variants": args.variants, "grad": args.grad,
            "errors": args.errors,
            "dtype": args.dtype,
            "seconds": seconds}
    json_path, md_path = write_report(results, args.out_dir, meta)
    counts = summarize(results)
    print(f"{counts['pass']} pass, {counts['fail']} fail, {counts['not-supported']} not-supported of "
          f"{counts['total']} OpInfos in {seconds} s; report: {md_path}, {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
