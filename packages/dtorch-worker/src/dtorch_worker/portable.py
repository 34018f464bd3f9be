"""Kernels, for any device, of the ops torch implements for the CPU alone that clients record.

To torch in the client every DTensor is a CPU tensor (`dtorch.device_mesh.WRAPPER_DEVICE`), so where torch picks
a kernel by device inside a composite the client records the CPU's choice: `F.scaled_dot_product_attention` becomes
`_scaled_dot_product_flash_attention_for_cpu`. A worker on another device (CUDA) runs the op below instead, with
the results laid out as the CPU kernel lays them out (the layout the client's metadata holds: its meta kernel's).

Rules:
1. A name in KERNELS runs its kernel here on every device but the CPU; on the CPU, torch's own kernel runs.
2. Each kernel computes what torch's CPU kernel computes (tests compare them on the CPU), in float32 at least.
3. A name in ON_HOST (asserts) is checked on the host on every device but the CPU, as torch's CPU kernel checks it:
   the device's own kernel fails a false assert inside the device (a device-side assert), which leaves the device
   unusable for every session of this worker until it restarts. The host check waits for the value (a sync of the
   stream); clients emit such an assert where a wrong index would otherwise give a silent wrong value
   (dtorch `_local.check_indices`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten


def _scores(query: torch.Tensor, key: torch.Tensor, is_causal: bool, attn_mask: torch.Tensor | None,
            scale: float | None) -> tuple[torch.Tensor, float, int]:
    """q k^T * scale with the causal and given masks, in float32 at least; and the heads sharing one key head."""
    group = query.shape[-3] // key.shape[-3]  # grouped-query attention: each key head serves `group` query heads
    if group > 1:
        key = key.repeat_interleave(group, dim=-3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    wide = torch.promote_types(query.dtype, torch.float32)
    s = torch.matmul(query.to(wide), key.to(wide).transpose(-2, -1)) * scale
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if attn_mask is not None:  # additive, of the query's dtype (the op takes no other)
        s = s + attn_mask.to(wide)
    return s, scale, group


def _no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise ValueError(f"flash attention with dropout_p={dropout_p} off the CPU: expected 0.0 (dropout is drawn "
                         "by the client as its own op)")


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                    is_causal: bool = False, *, attn_mask: torch.Tensor | None = None, scale: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    _no_dropout(dropout_p)
    s, _, group = _scores(query, key, is_causal, attn_mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    v = value.repeat_interleave(group, dim=-3) if group > 1 else value
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0), v.to(s.dtype))
    return out.to(query.dtype), lse


def flash_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             out: torch.Tensor, logsumexp: torch.Tensor, dropout_p: float, is_causal: bool, *,
                             attn_mask: torch.Tensor | None = None, scale: float | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _no_dropout(dropout_p)
    s, scale, group = _scores(query, key, is_causal, attn_mask, scale)
    wide = s.dtype
    p = torch.exp(s - logsumexp.to(wide).unsqueeze(-1)).nan_to_num(0.0)  # the forward's probabilities
    d_out, o = grad_out.to(wide), out.to(wide)
    v = (value.repeat_interleave(group, dim=-3) if group > 1 else value).to(wide)
    k = (key.repeat_interleave(group, dim=-3) if group > 1 else key).to(wide)
    d_v = torch.matmul(p.transpose(-2, -1), d_out)
    d_s = p * (torch.matmul(d_out, v.transpose(-2, -1)) - (d_out * o).sum(-1, keepdim=True))
    d_q = torch.matmul(d_s, k) * scale
    d_k = torch.matmul(d_s.transpose(-2, -1), query.to(wide)) * scale
    if group > 1:  # each key head's gradient sums over the query heads it served
        d_k = d_k.unflatten(-3, (key.shape[-3], group)).sum(-3)
        d_v = d_v.unflatten(-3, (value.shape[-3], group)).sum(-3)
    return d_q.to(query.dtype), d_k.to(key.dtype), d_v.to(value.dtype)


KERNELS: dict[str, Callable[..., Any]] = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": flash_attention,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": flash_attention_backward,
}


def assert_on_host(cond: torch.Tensor, assert_msg: str = "Expected Tensor with single nonzero value, but got zero"
                   ) -> None:
    """`aten._assert_async` as the CPU runs it (rule 3): RuntimeError with the message where `cond` is false."""
    if not bool(cond.item()):
        raise RuntimeError(assert_msg)


ON_HOST: dict[str, Callable[..., Any]] = {
    "aten._assert_async.default": assert_on_host,
    "aten._assert_async.msg": assert_on_host,
}


def _meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def kernel(name: str, op: torch._ops.OpOverload, device: torch.device) -> Callable[..., Any]:
    """What runs `op` (resolved from `name`) on `device` (rules 1 and 3)."""
    if device.type != "cpu" and name in ON_HOST:
        return ON_HOST[name]
    portable = KERNELS.get(name) if device.type != "cpu" else None
    if portable is None:
        return op

    def run(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        shapes = op(*[_meta(a) for a in args], **{k: _meta(v) for k, v in kwargs.items()})  # the CPU's layouts
        return tuple(torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=r.device).copy_(r)
                     for m, r in zip(shapes, portable(*args, **kwargs)))

    return run
