"""Optimizers whose update computes no number in Python, so that a training step that includes it can run as a
graph (`dtorch.compile(step, mode="graph")`, dtorch/_graph.py).

torch's AdamW computes its bias corrections and step sizes in Python from a per-parameter step counter, so every
step sends new numbers, and a step that includes it stays a replay (its `capturable=True` keeps the counter as a
plain tensor on the client). `dtorch.optim.AdamW` is the same update with the counters as replicated scalar
DTensors on each parameter's mesh: every number that changes from step to step is computed on the workers.

    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-3)

    @dtorch.compile(mode="graph")
    def train_step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

The arithmetic is torch's `capturable=True` AdamW (decoupled weight decay), so results match
`torch.optim.AdamW` up to float rounding, and match themselves bit for bit with and without capture. Its
hyperparameters (`lr`, `betas`, `eps`, `weight_decay` in `param_groups`, set by hand or by a scheduler) are the
graph's guard: a change runs the step's Python again (and, being a new number each time, keeps it a replay).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dtorch import _graph
from dtorch.dtensor import DTensor
from dtorch.factories import zeros
from dtorch_protocol.placement_types import Replicate


class AdamW(torch.optim.Optimizer):
    """`torch.optim.AdamW` for DTensor parameters, with its step counters on the workers (module docstring)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        for name, value, ok in (("lr", lr, lr >= 0), ("eps", eps, eps >= 0),
                                ("betas[0]", betas[0], 0 <= betas[0] < 1), ("betas[1]", betas[1], 0 <= betas[1] < 1),
                                ("weight_decay", weight_decay, weight_decay >= 0)):
            if not ok:
                raise ValueError(f"dtorch.optim.AdamW: {name}={value!r}; expected a value in its range "
                                 "(lr, eps, weight_decay >= 0; 0 <= betas < 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for i, p in enumerate(p for group in self.param_groups for p in group["params"]):
            if not isinstance(p, DTensor):
                raise TypeError(f"dtorch.optim.AdamW: parameter {i} is a {type(p).__name__}; expected DTensors "
                                "(torch.optim.AdamW serves plain tensors)")

    def _numbers(self) -> tuple:
        return tuple((g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in self.param_groups)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _graph.guard(self._numbers)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                _update(params, [self._state(p) for p in params], group)
        return loss

    def _state(self, p: DTensor) -> dict:
        state = self.state[p]
        if not state:
            mesh = p.device_mesh
            state["step"] = zeros(device_mesh=mesh, placements=[Replicate()] * mesh.ndim)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        return state


def _update(params: list, states: list[dict], group: dict) -> None:
    """One AdamW step over `params` (torch's multi-tensor `capturable=True` arithmetic)."""
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    grads = [p.grad for p in params]
    steps = [s["step"] for s in states]
    exp_avgs = [s["exp_avg"] for s in states]
    exp_avg_sqs = [s["exp_avg_sq"] for s in states]
    torch._foreach_add_(steps, 1)
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    step_size = torch._foreach_pow(beta1, steps)  # becomes lr / (1 - beta1 ** step), negated
    bias_correction2 = torch._foreach_pow(beta2, steps)  # becomes sqrt(1 - beta2 ** step)
    torch._foreach_sub_(step_size, 1)
    torch._foreach_sub_(bias_correction2, 1)
    torch._foreach_neg_(bias_correction2)
    torch._foreach_div_(step_size, lr)
    torch._foreach_reciprocal_(step_size)
    torch._foreach_sqrt_(bias_correction2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(denom, step_size)
    torch._foreach_addcdiv_(params, exp_avgs, denom)
