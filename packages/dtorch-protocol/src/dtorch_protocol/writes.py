"""Ops that write arguments their schema does not mark as written (`Tensor(a!)`).

The client's plans read an op's writes from its schema (a written argument that had to move is copied back, and
the controller is told which tensors changed, for snapshots); the worker reads them to order a write after the
reads in flight. A few kernels write more than their schema says: `native_batch_norm` (and the cudnn and miopen
kernels behind `batch_norm` on GPUs) update `running_mean` and `running_var` in place while training, and
`batch_norm_update_stats` always, yet declare them `Tensor?` (`_native_batch_norm_legit` is the same op with an
honest schema). Without this table a BatchNorm
whose input is sharded over its channels trained with running statistics that never moved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_STATS = ("running_mean", "running_var")
UNDECLARED_WRITES: dict[str, tuple[tuple[str, ...], str]] = {  # op -> (arguments written, the flag that must be
    # true for the write; "": always)
    "aten.native_batch_norm.default": (_STATS, "training"),
    "aten.native_batch_norm.out": (_STATS, "training"),
    "aten.cudnn_batch_norm.default": (_STATS, "training"),
    "aten.cudnn_batch_norm.out": (_STATS, "training"),
    "aten.miopen_batch_norm.default": (_STATS, "training"),
    "aten.miopen_batch_norm.out": (_STATS, "training"),
    "aten.batch_norm_update_stats.default": (_STATS, ""),
    "aten.batch_norm_update_stats.out": (_STATS, ""),
}


def undeclared_writes(op: str, names: Sequence[str], args: Sequence[Any] | None = None,
                      kwargs: Mapping[str, Any] | None = None) -> frozenset[str]:
    """The arguments `op` (named `names`, in schema order) writes beyond its schema, for these `args` and `kwargs`;
    without args, every argument it may write."""
    rule = UNDECLARED_WRITES.get(op)
    if rule is None:
        return frozenset()
    written, flag = rule
    if args is not None and flag:
        at = names.index(flag)
        if not (args[at] if at < len(args) else (kwargs or {}).get(flag, False)):
            return frozenset()
    return frozenset(written)


def written_arguments(op: str, arguments: Sequence[Any], args: Sequence[Any] | None = None,
                      kwargs: Mapping[str, Any] | None = None) -> list[tuple[int, str]]:
    """(position, name) of the arguments `op` writes, given its schema's `arguments` (torch's `Argument`s): those the
    schema marks (`Tensor(a!)`: self of an in-place op, out=) and those of the table, for these args (without
    args: any it may write). The client's plans and the worker both ask here."""
    unmarked = undeclared_writes(op, [a.name for a in arguments], args, kwargs)
    return [(i, a.name) for i, a in enumerate(arguments)
            if a.alias_info is not None and a.alias_info.is_write or a.name in unmarked]
