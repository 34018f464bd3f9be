"""Placements, as `torch.distributed.tensor.placement_types` names them (defined in `dtorch_protocol`)."""

from dtorch_protocol.placement_types import REDUCE_OPS, Partial, Placement, Replicate, Shard, placement_from_wire

__all__ = ["REDUCE_OPS", "Partial", "Placement", "Replicate", "Shard", "placement_from_wire"]
