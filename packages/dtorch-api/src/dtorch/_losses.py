"""Losses with reduction "mean" on sharded tensors (a batch split over devices): the mean over the whole tensor, not
a mean of the shards' means.

torch's DTensor rules turn a loss op's "mean" into Partial("avg") over the sharded dims, which is the mean only when
every shard holds as many elements, and as much target weight, as the others. A batch of 5 rows on 2 devices (3 and
2) gave a wrong loss and wrong gradients for mse_loss, smooth_l1, huber, binary cross entropy (with logits too) and
soft margin; on even shards, ignored targets (`ignore_index`) or class weights did the same to nll_loss.

Rules (decompositions, `_registry.register_decomposition`; each declines, NotImplemented, unless the reduction is
MEAN and some DTensor argument is sharded):
  1. A loss op of table ELEMENTWISE (one loss per element of its input) with reduction MEAN is the op with
     reduction NONE, then `mean` (whose rule is exact on uneven shards).
  2. Its backward (table BACKWARD) with reduction MEAN is the backward with reduction NONE of the incoming gradient
     spread over the input's elements: `grad_output.expand(self.shape) / self.numel()`.
  3. nll_loss (nll_loss2d) forward with reduction MEAN is its SUM divided by its total weight; the total weight it
     returns is the sum over the shards, which is what its backward divides by.
  4. nll_loss of (rows, classes) log-probabilities whose class dim is sharded (a vocabulary-parallel head, after
     `_softmax`'s log-softmax), any reduction, and its backward: torch's rule gathers the classes whole. Instead,
     each device compares its own classes with the targets (a one-hot of its shard: the class indices, made on the
     workers and laid out as the classes) and sums what it holds of each row's target: one all-reduced value per
     row. Weights and ignored targets apply per row as torch's kernel does; the backward puts -weight x gradient
     at each row's target, in the classes' layout. A target outside the classes (and not ignored) fails the forward,
     as torch's kernel does (`_local.check_indices`), instead of picking zero.
Reduction codes are torch's: NONE 0, MEAN 1, SUM 2.
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._local import check_indices, is_dtensor, sharded_dim, to
from dtorch._registry import named_args, register_decomposition
from dtorch_protocol.placement_types import Replicate, Shard

aten = torch.ops.aten
NONE, MEAN, SUM = 0, 1, 2

ELEMENTWISE = (aten.mse_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default,
               aten.binary_cross_entropy.default, aten.binary_cross_entropy_with_logits.default,
               aten.soft_margin_loss.default)
BACKWARD = (aten.mse_loss_backward.default, aten.smooth_l1_loss_backward.default, aten.huber_loss_backward.default,
            aten.binary_cross_entropy_backward.default, aten.soft_margin_loss_backward.default)
NLL = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)


def _sharded(args: list, kwargs: dict) -> bool:
    return any(is_dtensor(v) and any(isinstance(p, Shard) for p in v.placements)
               for v in (*args, *kwargs.values()))


def _class_sharded(self: Any, target: Any) -> bool:
    return getattr(self, "ndim", 0) == 2 and sharded_dim(self, dim=1) and not (
        is_dtensor(target) and any(p.is_partial() for p in target.placements))


def _picks(self: Any, target: Any, weight: Any, ignore_index: int) -> tuple[Any, Any]:
    """(the one-hot of each row's target in self's class layout, each row's weight) for rule 4."""
    classes = aten.sub.Tensor(aten.cumsum.default(aten.new_ones.default(self, [self.shape[1]], dtype=torch.int64), 0),
                              1)
    classes = to(classes, tuple(Shard(0) if isinstance(p, Shard) and p.dim == 1 else Replicate()
                                for p in self.placements))
    onehot = aten.eq.Tensor(aten.unsqueeze.default(target, 1), classes)
    kept = aten.ne.Scalar(target, ignore_index)
    if weight is None:
        row_weight = aten._to_copy.default(kept, dtype=self.dtype)
    else:
        safe = aten.where.self(kept, target, aten.zeros_like.default(target))
        row_weight = aten.where.self(kept, aten.index.Tensor(weight, [safe]), aten.zeros_like.default(safe,
                                                                                                     dtype=self.dtype))
    return onehot, row_weight


def _nll_by_class_shard(args: tuple, kwargs: dict) -> Any:  # rule 4, forward
    values = named_args(aten.nll_loss_forward.default, args, kwargs)
    self, target, weight = values["self"], values["target"], values.get("weight")
    if not _class_sharded(self, target):
        return NotImplemented
    ignore, classes = values.get("ignore_index", -100), self.shape[1]
    check_indices(target, classes, f"Target out of bounds: a target of nll_loss is outside the {classes} classes, "
                                   f"expected each in [0, {classes}) or ignore_index ({ignore})", allowed=ignore)
    onehot, row_weight = _picks(self, target, weight, ignore)
    picked = aten.sum.dim_IntList(aten.where.self(onehot, self, aten.new_zeros.default(self, [])), [1])
    losses = aten.neg.default(aten.mul.Tensor(picked, row_weight))
    reduction = values.get("reduction", MEAN)
    if reduction == NONE:
        return losses, aten.new_zeros.default(self, [])
    total, total_weight = aten.sum.default(losses), aten.sum.default(row_weight)
    return (aten.div.Tensor(total, total_weight) if reduction == MEAN else total), total_weight


@register_decomposition(aten.nll_loss_backward.default)
def nll_backward_by_class_shard(args: tuple, kwargs: dict) -> Any:  # rule 4, backward
    values = named_args(aten.nll_loss_backward.default, args, kwargs)
    grad, self, target = values["grad_output"], values["self"], values["target"]
    if not _class_sharded(self, target):
        return NotImplemented
    onehot, row_weight = _picks(self, target, values["weight"], values["ignore_index"])
    if values["reduction"] == MEAN:
        grad = aten.div.Tensor(grad, values["total_weight"])
    per_row = aten.neg.default(aten.mul.Tensor(row_weight, grad))
    return aten.where.self(onehot, aten.unsqueeze.default(per_row, 1), aten.new_zeros.default(self, []))


def _decomposition(op: Any) -> Any:
    names = [a.name for a in op._schema.arguments]
    at = names.index("reduction")  # positional where the caller put it there, else a keyword (default: MEAN)
    default = op._schema.arguments[at].default_value

    def run(args: tuple, kwargs: dict) -> Any:
        positional = at < len(args)
        reduction = args[at] if positional else kwargs.get("reduction", MEAN if default is None else default)
        if op is aten.nll_loss_forward.default and (done := _nll_by_class_shard(args, kwargs)) is not NotImplemented:
            return done
        if reduction != MEAN or not _sharded(args, kwargs):
            return NotImplemented

        def call(value: int, args: tuple = args) -> Any:
            if positional:
                return op(*args[:at], value, *args[at + 1:], **kwargs)
            return op(*args, **{**kwargs, "reduction": value})

        if op in NLL:  # rule 3
            total, total_weight = call(SUM)
            return aten.div.Tensor(total, total_weight), total_weight
        if op in BACKWARD:  # rule 2: grad_output, then self
            grad, self = args[0], args[1]
            return call(NONE, (aten.div.Scalar(aten.expand.default(grad, list(self.shape)), self.numel()), *args[1:]))
        return aten.mean.default(call(NONE))  # rule 1

    return run


for _op in (*ELEMENTWISE, *BACKWARD, *NLL):
    register_decomposition(_op)(_decomposition(_op))
