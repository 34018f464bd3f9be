"""Mixed precision's gradient scaler (`torch.amp.GradScaler`) on DTensor gradients.

The scaler keeps its scale and its found-inf flag as plain tensors in the user's process and unscales the
gradients with `_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)`, which writes both. Its
`step` then reads the flag (`found_inf.item()`) to skip the optimizer's step on a non-finite gradient. With
DTensor gradients the op is carried out as (a decomposition, `_registry.register_decomposition`):
  1. the largest magnitude of every gradient (`_foreach_norm(grads, inf)`: NaN or inf where a gradient holds one,
     on any shard), before unscaling;
  2. the gradients multiplied by `inv_scale` in place (`_foreach_mul_`);
  3. per mesh, one read of whether any of those magnitudes is not finite; the plain `found_inf` is set to 1 if so,
     as torch's kernel sets it. This is the sync point the scaler's `step` would reach anyway.
Gradients that are plain tensors go to torch's kernel as they are. It declines (NotImplemented) where `found_inf`
is itself a DTensor.
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._local import is_dtensor
from dtorch._registry import register_decomposition

aten = torch.ops.aten


@register_decomposition(aten._amp_foreach_non_finite_check_and_unscale_.default)
def unscale(args: tuple, kwargs: dict) -> Any:
    values = dict(zip(("self", "found_inf", "inv_scale"), args), **kwargs)
    grads, found_inf, inv_scale = values["self"], values["found_inf"], values["inv_scale"]
    if is_dtensor(found_inf) or is_dtensor(inv_scale):
        return NotImplemented
    plain = [g for g in grads if not is_dtensor(g)]
    if plain:
        aten._amp_foreach_non_finite_check_and_unscale_.default(plain, found_inf, inv_scale)
    by_mesh: dict[Any, list] = {}
    for g in grads:
        if is_dtensor(g):
            by_mesh.setdefault(g.device_mesh, []).append(g)
    peaks = {mesh: aten._foreach_norm.Scalar(group, float("inf")) for mesh, group in by_mesh.items()}  # rule 1
    for group in by_mesh.values():  # rule 2
        aten._foreach_mul_.Tensor(group, inv_scale)
    for group in peaks.values():  # rule 3
        if not bool(aten.all.default(aten.isfinite.default(aten.stack.default(group)))):
            found_inf.fill_(1.0)
    return None
