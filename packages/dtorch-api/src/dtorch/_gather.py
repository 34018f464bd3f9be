"""`gather` with an index smaller than its input on a dim it does not gather along.

`input.gather(dim, index)` reads `input[i][index[i][j]]` (dim 1): on every other dim `d`, index row `i` pairs with
input row `i`, and `index.size(d)` may be smaller than `input.size(d)` (the rows beyond are not read). torch's
DTensor rule shards input and index alike on such a dim, which pairs the shards' rows only when both have as many:
`x.gather(1, idx)` of a [10, 5] input and a [5, 5] index, sharded on dim 0, gave wrong values, and so did
`scatter_add`'s gradient, which is this gather.

Rule (a decomposition, `_registry.register_decomposition`): where such a dim is sharded in the input or the index,
the input is first narrowed to the index's size on it (`input.narrow(d, 0, index.size(d))`, which is what gather
reads; its gradient pads with zeros), and then gathered. It declines (NotImplemented) otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._local import is_dtensor
from dtorch._registry import register_decomposition
from dtorch_protocol.placement_types import Shard

aten = torch.ops.aten


def _sharded_dims(t: Any) -> set[int]:
    return {p.dim for p in t.placements if isinstance(p, Shard)} if is_dtensor(t) else set()


@register_decomposition(aten.gather.default)
def gather(args: tuple, kwargs: dict) -> Any:
    values = dict(zip(("self", "dim", "index", "sparse_grad"), args), **kwargs)
    x, index = values["self"], values["index"]
    sharded = _sharded_dims(x) | _sharded_dims(index)
    if not sharded:  # the common case, answered first
        return NotImplemented
    dim = values["dim"] % max(x.dim(), 1)
    shorter = [d for d in range(index.dim()) if d != dim and index.shape[d] < x.shape[d]]
    if not any(d in sharded for d in shorter):
        return NotImplemented
    for d in shorter:
        x = aten.narrow.default(x, d, 0, index.shape[d])
    return aten.gather.default(x, values["dim"], index, sparse_grad=values.get("sparse_grad", False))
