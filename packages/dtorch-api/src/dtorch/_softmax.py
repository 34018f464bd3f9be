"""Softmax and log-softmax over a sharded dim: a vocabulary split over devices (tensor-parallel logits).

torch's rule gathers the whole dim on every device first, so the logits of a vocabulary-parallel head (a
`ColwiseParallel` whose output stays `Shard(-1)`) were gathered whole, tokens x vocabulary on every device, for each
loss. As Megatron's vocabulary-parallel cross entropy does, DTorch reduces a maximum and a sum per row instead
(decompositions, `_registry.register_decomposition`):
  1. `_log_softmax(x, dim)` is x - m - log(sum(exp(x - m), dim)) and `_softmax(x, dim)` is exp(x - m) / sum(exp(x -
     m), dim), with m = amax(x, dim): one all-reduced maximum and one all-reduced sum per row; the output keeps x's
     layout.
  2. Their backwards: `_log_softmax_backward_data(g, out)` is g - exp(out) * sum(g, dim) and
     `_softmax_backward_data(g, out)` is out * (g - sum(g * out, dim)): one all-reduced sum per row. A gradient
     laid out otherwise (replicated: the gradient of the labels' log-probabilities, `gather_backward`, is) is
     laid out as `out` first; torch's rule gathered `out` whole instead.
  3. `logsumexp(x, dims)` over dims one of which is sharded is m + log(sum(exp(x - m), dims)), m = amax(x, dims) (0
     where infinite, as torch's): one all-reduced maximum and one all-reduced sum per row (torch's rule gathered
     the whole dim; a floating x only).
Each declines (NotImplemented) unless `dim` is sharded on some mesh dim, every device holds some of it, and no input
is Partial. The loss that follows (`nll_loss` over a sharded class dim) is `_losses` rule 4.
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._local import is_dtensor, sharded_dim, to
from dtorch._registry import named_args, register_decomposition
from dtorch_protocol.placement_types import Replicate

aten = torch.ops.aten


def _reduced(t: Any) -> Any:
    """A row's reduction over the sharded dim, all-reduced (Partial -> Replicate) before it meets the rows again:
    left Partial, a product with it would be Partial too, and reduced at full size."""
    return to(t, tuple(Replicate() if p.is_partial() else p for p in t.placements))


def _row_max(x: Any, dim: int | list[int]) -> Any:
    return _reduced(aten.amax.default(x, dim if isinstance(dim, list) else [dim], True))


def _row_sum(x: Any, dim: int | list[int]) -> Any:
    return _reduced(aten.sum.dim_IntList(x, dim if isinstance(dim, list) else [dim], True))


def _forward_input(args: tuple, kwargs: dict) -> tuple[Any, int] | None:
    """(x, dim) of `_softmax`/`_log_softmax` (x in float32 under half_to_float), or None where they decline."""
    values = named_args(aten._softmax.default, args, kwargs)  # (_log_softmax's are the same)
    x, dim = values["self"], values["dim"]
    if not sharded_dim(x, dim=dim):
        return None
    return (aten._to_copy.default(x, dtype=torch.float32) if values["half_to_float"] else x), dim


def _backward_input(args: tuple, kwargs: dict) -> tuple[Any, Any, int, torch.dtype] | None:
    """(grad, out, dim, input dtype) of the backwards, or None where they decline."""
    values = named_args(aten._softmax_backward_data.default, args, kwargs)  # (_log_softmax_backward_data's too)
    grad, out, dim = values["grad_output"], values["output"], values["dim"]
    if not sharded_dim(out, dim=dim) or not is_dtensor(grad) or grad._spec.has_partial():
        return None
    return to(grad, out.placements), out, dim, values["input_dtype"]  # (a replicated grad: a local slice)


def _as(t: Any, dtype: torch.dtype) -> Any:
    return t if t.dtype == dtype else aten._to_copy.default(t, dtype=dtype)


@register_decomposition(aten._log_softmax.default)
def log_softmax(args: tuple, kwargs: dict) -> Any:
    if (found := _forward_input(args, kwargs)) is None:
        return NotImplemented
    x, dim = found
    shifted = aten.sub.Tensor(x, _row_max(x, dim))
    return aten.sub.Tensor(shifted, aten.log.default(_row_sum(aten.exp.default(shifted), dim)))


@register_decomposition(aten._softmax.default)
def softmax(args: tuple, kwargs: dict) -> Any:
    if (found := _forward_input(args, kwargs)) is None:
        return NotImplemented
    x, dim = found
    exp = aten.exp.default(aten.sub.Tensor(x, _row_max(x, dim)))
    return aten.div.Tensor(exp, _row_sum(exp, dim))


@register_decomposition(aten._log_softmax_backward_data.default)
def log_softmax_backward(args: tuple, kwargs: dict) -> Any:
    if (found := _backward_input(args, kwargs)) is None:
        return NotImplemented
    grad, out, dim, dtype = found
    return _as(aten.sub.Tensor(grad, aten.mul.Tensor(aten.exp.default(out), _row_sum(grad, dim))), dtype)


@register_decomposition(aten._softmax_backward_data.default)
def softmax_backward(args: tuple, kwargs: dict) -> Any:
    if (found := _backward_input(args, kwargs)) is None:
        return NotImplemented
    grad, out, dim, dtype = found
    return _as(aten.mul.Tensor(out, aten.sub.Tensor(grad, _row_sum(aten.mul.Tensor(grad, out), dim))), dtype)


@register_decomposition(aten.logsumexp.default)
def logsumexp(args: tuple, kwargs: dict) -> Any:  # rule 3
    values = named_args(aten.logsumexp.default, args, kwargs)
    x, dims = values["self"], values["dim"]
    if not dims or not x.is_floating_point() or not any(sharded_dim(x, dim=d) for d in dims):
        return NotImplemented
    dims = sorted({d % x.ndim for d in dims})
    m = _row_max(x, dims)
    m = aten.masked_fill.Scalar(m, aten.eq.Scalar(aten.abs.default(m), float("inf")), 0.0)
    out = aten.add.Tensor(aten.log.default(_row_sum(aten.exp.default(aten.sub.Tensor(x, m)), dims)), m)
    return out if values["keepdim"] else aten.squeeze.dims(out, dims)
