"""The portable kernels of CPU-only ops compute what torch's CPU kernels compute, laid out as they lay it out."""

from __future__ import annotations

import pytest
import torch

from dtorch_worker import portable
from dtorch_worker.ops import resolve_op

FWD = "aten._scaled_dot_product_flash_attention_for_cpu.default"
BWD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
CASES = {  # (query heads, key heads, L, S, is_causal, mask)
    "plain": (4, 4, 5, 7, False, None),
    "causal": (4, 4, 6, 6, True, None),
    "causal, L < S": (2, 2, 3, 6, True, None),
    "float mask": (2, 2, 5, 6, False, "float"),
    "grouped query": (4, 2, 5, 6, True, None),
}


def _inputs(hq: int, hk: int, lq: int, ls: int, mask: str | None, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, lq, hq, 8, generator=g).transpose(1, 2).to(dtype)  # as models pass it: heads second
    k, v = (torch.randn(2, hk, ls, 8, generator=g).to(dtype) for _ in range(2))
    m = None
    if mask == "float":
        m = torch.randn(1, 1, lq, ls, generator=g).to(dtype)
    return q, k, v, m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_flash_attention_for_cpu_forward_and_backward_match_torch(case, dtype):
    hq, hk, lq, ls, causal, mask = CASES[case]
    q, k, v, m = _inputs(hq, hk, lq, ls, mask, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    fwd, bwd = resolve_op(FWD), resolve_op(BWD)
    out, lse = fwd(q, k, v, 0.0, causal, attn_mask=m, scale=0.3)
    ours = portable.kernel(FWD, fwd, torch.device("meta"))  # any device but the CPU takes the portable kernel
    assert ours is not fwd and portable.kernel(FWD, fwd, torch.device("cpu")) is fwd
    got_out, got_lse = ours(q, k, v, 0.0, causal, attn_mask=m, scale=0.3)
    assert (got_out.stride(), got_lse.stride(), got_out.dtype, got_lse.dtype) == (
        out.stride(), lse.stride(), out.dtype, lse.dtype)
    torch.testing.assert_close(got_out, out, atol=tol, rtol=tol)
    torch.testing.assert_close(got_lse, lse, atol=tol, rtol=tol)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = bwd(grad, q, k, v, out, lse, 0.0, causal, attn_mask=m, scale=0.3)
    got = portable.kernel(BWD, bwd, torch.device("meta"))(grad, q, k, v, out, lse, 0.0, causal, attn_mask=m,
                                                          scale=0.3)
    for name, a, b in zip("qkv", got, expected):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), name
        torch.testing.assert_close(a, b, atol=tol * 4, rtol=tol * 4, msg=lambda s, n=name: f"grad {n}: {s}")


def test_dropout_off_the_cpu_is_one_clear_line():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"dropout_p=0.5 off the CPU: expected 0.0"):
        portable.flash_attention(q, q, q, 0.5)


@pytest.mark.parametrize("name", ["aten._assert_async.msg", "aten._assert_async.default"])
def test_an_assert_off_the_cpu_is_checked_on_the_host_as_the_cpu_checks_it(name):
    """On CUDA, torch's `_assert_async` fails inside the device (a device-side assert), which leaves the device unusable
    for every session of the worker: off the CPU the worker checks it on the host instead, with the CPU's error."""
    op = resolve_op(name)
    ours = portable.kernel(name, op, torch.device("meta"))  # any device but the CPU
    assert ours is not op and portable.kernel(name, op, torch.device("cpu")) is op
    args = ("an index is out of range",) if name.endswith(".msg") else ()
    ours(torch.tensor(True), *args)
    for cond in (torch.tensor(False), torch.tensor([0])):
        with pytest.raises(RuntimeError) as theirs:
            op(cond, *args)
        with pytest.raises(RuntimeError) as got:
            ours(cond, *args)
        assert str(got.value) == str(theirs.value)
