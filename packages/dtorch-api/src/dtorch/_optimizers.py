"""torch's fused optimizer kernels that have no sharding rule, on DTensors: `SGD(fused=True)` and
`Adagrad(fused=True)`. torch's rules cover the fused Adam and AdamW kernels; these two failed ("output shapes that
depend on the values", "would write into the plain torch.Tensor 'state_steps'"), as they do on torch's DTensor.

Rules (decompositions, `_registry.register_decomposition`): each kernel is carried out as the foreach ops of its
math, in the order its CPU kernel computes it (`FusedSGDKernel.cpp`, `FusedAdagradKernel.cpp`):
  1. GradScaler's `found_inf` (a plain tensor) set: no step. Its `grad_scale`: the gradients are divided by it in
     place, as the kernels write them back.
  2. `maximize` negates the gradient; `weight_decay` adds `weight_decay * param` to it.
  3. SGD: with momentum, the buffer is the gradient at the first step, else `momentum * buf + (1 - dampening) *
     grad`; the direction is `grad + momentum * buf` (nesterov) or the buffer; `param -= lr * direction`.
  4. Adagrad: `state_sum += grad * grad`, then `param -= clr * grad / (sqrt(state_sum) + eps)` with
     `clr = lr / (1 + (step - 1) * lr_decay)`, each parameter's `step` read from its plain step tensor (the optimizer
     increments it before the kernel, which only reads it, whatever the schema says).
A learning rate given as a tensor is read once.
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._registry import named_args, register_decomposition

aten = torch.ops.aten


def _number(v: Any) -> float:
    return float(v) if isinstance(v, torch.Tensor) else v


def _gradients(v: dict[str, Any]) -> list | None:
    """Rules 1 and 2: the gradients the step uses, or None where GradScaler found an inf or a NaN."""
    if v["found_inf"] is not None and bool(v["found_inf"]):
        return None
    grads = list(v["grads"])
    if v["grad_scale"] is not None:
        aten._foreach_div_.Scalar(grads, _number(v["grad_scale"]))
    if v["maximize"]:
        grads = aten._foreach_neg.default(grads)
    if v["weight_decay"]:
        grads = aten._foreach_add.List(grads, v["self"], alpha=v["weight_decay"])
    return grads


def _sgd(v: dict[str, Any], grads: list) -> None:  # rule 3
    params, bufs, momentum = v["self"], v["momentum_buffer_list"], v["momentum"]
    if momentum:
        if v["is_first_step"]:
            aten._foreach_copy_.default(bufs, grads)
        else:
            aten._foreach_mul_.Scalar(bufs, momentum)
            aten._foreach_add_.List(bufs, grads, alpha=1 - v["dampening"])
        grads = aten._foreach_add.List(grads, bufs, alpha=momentum) if v["nesterov"] else bufs
    aten._foreach_add_.List(params, grads, alpha=-_number(v["lr"]))


def _adagrad(v: dict[str, Any], grads: list) -> None:  # rule 4
    lr, decay, sums = _number(v["lr"]), v["lr_decay"], v["state_sums"]
    aten._foreach_addcmul_.Scalar(sums, grads, grads)
    std = aten._foreach_sqrt.default(sums)
    aten._foreach_add_.Scalar(std, v["eps"])
    steps = [-lr / (1 + (float(s) - 1) * decay) for s in v["state_steps"]]
    aten._foreach_addcdiv_.ScalarList(v["self"], grads, std, steps)


def _decomposition(func: Any, math: Any) -> Any:
    """One overload of a fused kernel: its arguments by name, rules 1 and 2, then its `math`."""
    def step(args: tuple, kwargs: dict) -> None:
        v = named_args(func, args, kwargs)
        grads = _gradients(v)
        if grads is not None:
            math(v, grads)
    return step


for _op, _math in ((aten._fused_sgd_.default, _sgd), (aten._fused_sgd_.tensor_lr, _sgd),
                   (aten._fused_adagrad_.default, _adagrad), (aten._fused_adagrad_.tensor_lr, _adagrad)):
    register_decomposition(_op)(_decomposition(_op, _math))
