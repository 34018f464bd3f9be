"""Sharding rules DTorch writes itself, where torch has none: CPU flash attention (forward and backward).
Each registers its ops in `_registry` (see there for how to add a rule module).

Per mesh dim, the query's placement picks the layout of the whole op:
  Shard(0) batch / Shard(1) heads   every input and output sharded the same way (heads: q and kv heads
                                    equal, as after transformers' repeat_kv, or grouped-query attention's
                                    fewer kv heads split evenly, so that each device holds the kv heads its
                                    query heads read)
  Shard(2) sequence                 context parallelism: queries stay sharded, keys and values are
                                    gathered; a causal mask becomes a per-device mask of the device's
                                    query rows (`is_causal` aligns top-left, which a shard would break);
                                    in backward, key and value gradients come out Partial("sum")
  anything else                     Replicate
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._registry import NoRule, Propagation, register
from dtorch._sharding import meta_specs
from dtorch._spec import Spec
from dtorch.device_mesh import DeviceMesh
from dtorch_protocol.layout import coords, shard_box
from dtorch_protocol.placement_types import Partial, Placement, Replicate, Shard

aten = torch.ops.aten
_R = Replicate()


def _roles(q: Spec, k: Spec) -> list[str]:
    roles, split = [], 1  # split: how many parts the heads are cut into
    for p, n in zip(q.placements, q.mesh.shape):
        if isinstance(p, Shard) and p.dim in (0, 1, 2):
            roles.append("bhs"[p.dim])
            split *= n if p.dim == 1 else 1
        else:
            roles.append("r")
    heads, kv_heads = q.shape[1], k.shape[1]
    if split > 1 and heads != kv_heads and (heads % kv_heads or kv_heads % split):
        raise NoRule("heads sharded, but the key/value heads do not split evenly with the query heads they serve")
    if roles.count("s") > 1:
        raise NoRule("sequence sharded on more than one mesh dim")
    if any(n == 0 for c in coords(q.mesh.shape) for _, n in shard_box(q.shape, q.mesh.shape, q.placements, c)):
        raise NoRule("an empty shard")  # the CPU kernel divides by zero heads or rows (SIGFPE)
    return roles


def _place(roles: list[str], kind: str, spec: Spec | None) -> tuple[Placement, ...] | None:
    """Placements for one operand: kind "q" follows the roles, "kv" is gathered on the sequence dim,
    "mask" (its dims aligned with the query's from the right: a 2-d mask is query rows x keys) is sharded like the
    query where it has that dim, and replicated where it has not or broadcasts it (size 1)."""
    if spec is None:
        return None
    out: list[Placement] = []
    for role in roles:
        dim = "bhs".find(role)
        at = len(spec.shape) - 4 + dim if kind == "mask" else dim
        if role == "r" or (role == "s" and kind == "kv") or at < 0 or (kind == "mask" and spec.shape[at] == 1):
            out.append(_R)
        else:
            out.append(Shard(at))
    return tuple(out)


def _causal_masks(q: Spec, k_len: int, mesh: DeviceMesh, q_placements: tuple[Placement, ...]) -> list[torch.Tensor]:
    """Per device, the additive causal mask rows of the queries it holds (flash attention on CPU wants
    the query's dtype: 0 attends, -inf does not), aligned top-left as torch's `is_causal` is."""
    masks = []
    for c in coords(mesh.shape):
        start, length = shard_box(tuple(q.shape), mesh.shape, q_placements, c)[2]
        rows = torch.arange(start, start + length).unsqueeze(1)
        allowed = torch.arange(k_len).unsqueeze(0) <= rows
        masks.append(torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, float("-inf")))
    return masks


def _plan(func: Any, args: tuple, kwargs: dict, mesh: DeviceMesh, layout: dict[int, str], q: Spec, k: Spec,
          out_kinds: list[str], causal_index: int) -> Propagation:
    roles = _roles(q, k)
    if any(isinstance(v, Spec) and v.has_partial() for v in (*args, *kwargs.values())):
        raise NoRule("partial inputs")
    # by position: q, k and v made by the same cached plans share one Spec object
    new_args, new_kwargs = list(args), dict(kwargs)
    for index, kind in layout.items():
        spec = args[index] if index >= 0 else kwargs.get("attn_mask")
        if isinstance(spec, Spec):
            moved = spec.with_placements(_place(roles, kind, spec))
            if index >= 0:
                new_args[index] = moved
            else:
                new_kwargs["attn_mask"] = moved
    new_args = tuple(new_args)
    outs = meta_specs(func, args, kwargs, mesh)
    out_specs = tuple(o.with_placements(tuple(
        Partial() if kind == "kv_grad" and role == "s" else
        (_R if role == "r" or (role == "s" and kind == "kv_grad") else Shard("bhs".find(role)))
        for role in roles)) for o, kind in zip(outs, out_kinds))
    rank_args = None
    is_causal = len(args) > causal_index and bool(args[causal_index])
    if "s" in roles and is_causal:
        if kwargs.get("attn_mask") is not None:
            raise NoRule("is_causal together with attn_mask")
        masks = _causal_masks(q, k.shape[2], mesh, _place(roles, "q", q))
        rank_args = []
        for mask in masks:
            a = list(new_args)
            a[causal_index] = False
            rank_args.append((tuple(a), {**new_kwargs, "attn_mask": mask}))
    return Propagation(func, new_args, new_kwargs, rank_args, out_specs)


@register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def flash_attention_cpu(func: Any, args: tuple, kwargs: dict, mesh: DeviceMesh) -> Propagation:
    q, k = args[0], args[1]
    if len(q.shape) != 4 or (len(args) > 3 and args[3]):
        raise NoRule("needs 4-d inputs and no dropout")
    return _plan(func, args, kwargs, mesh, {0: "q", 1: "kv", 2: "kv", -1: "mask"}, q, k, ["q", "q_lse"], 4)


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def flash_attention_cpu_backward(func: Any, args: tuple, kwargs: dict, mesh: DeviceMesh) -> Propagation:
    q, k = args[1], args[2]
    if len(q.shape) != 4 or args[6]:
        raise NoRule("needs 4-d inputs and no dropout")
    layout = {0: "q", 1: "q", 2: "kv", 3: "kv", 4: "q", 5: "q", -1: "mask"}
    return _plan(func, args, kwargs, mesh, layout, q, k, ["q", "kv_grad", "kv_grad"], 7)

