"""transfer.byte_view: the raw bytes of any local shard, whatever its strides."""

from __future__ import annotations

import torch

from dtorch_worker.transfer import byte_view


def test_byte_view_of_size_one_dims_with_odd_strides():
    # contiguous() keeps these as they are (size-1 dims may have any stride): expand of a 0-d tensor, and a
    # one-element row of a shard
    cases = [torch.tensor(2.5).expand(1, 1), torch.arange(25.0).reshape(5, 5)[1:2, 0], torch.randn(3, 4).t()]
    for t in cases:
        assert bytes(byte_view(t)) == t.contiguous().numpy().tobytes()
