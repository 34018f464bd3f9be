"""Debugging tools named as torch's (`torch.distributed.tensor.debug`): `CommDebugMode` counts the collectives a
block's redistributions are, per kind and per module; `visualize_sharding` prints which devices hold which part
of a 1-D or 2-D DTensor. `dtorch.profile()` measures the time they take."""

from dtorch.debug._comm_mode import CommDebugMode
from dtorch.debug._visualize_sharding import visualize_sharding

__all__ = ["CommDebugMode", "visualize_sharding"]
