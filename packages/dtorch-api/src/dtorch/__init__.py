"""DTorch: distributed tensors for ordinary, single-threaded PyTorch code.

    import dtorch
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    x = dtorch.rand((4, 3), device_mesh=mesh, placements=[dtorch.Shard(0)])

Names follow `torch.distributed.tensor`. Heavy modules load on first use; the wire protocol lives in the
torch-free `dtorch_protocol` package.
"""

from __future__ import annotations

import importlib
from typing import Any

from dtorch._version import __version__
from dtorch_protocol.placement_types import Partial, Placement, Replicate, Shard

_LAZY = {
    "DeviceMesh": "dtorch.device_mesh",
    "init_device_mesh": "dtorch.device_mesh",
    "DTensor": "dtorch.factories",  # (which gives it `DTensor.from_local`)
    "distribute_tensor": "dtorch.factories",
    "distribute_module": "dtorch.nn",
    "rand": "dtorch.factories",
    "randn": "dtorch.factories",
    "zeros": "dtorch.factories",
    "ones": "dtorch.factories",
    "full": "dtorch.factories",
    "empty": "dtorch.factories",
    "arange": "dtorch.factories",
    "manual_seed": "dtorch.factories",
    "DTorchError": "dtorch.errors",
    "connect": "dtorch.runtime",
    "shutdown": "dtorch.runtime",
    "status": "dtorch.runtime",
    "synchronize": "dtorch.runtime",
    "drain": "dtorch.runtime",
    "migrate": "dtorch.runtime",
    "compile": "dtorch.steps",
    "auto_compile": "dtorch.steps",
    "profile": "dtorch.profiling",
}

# `dtorch.optim.AdamW` after a plain `import dtorch`, as with torch
_SUBMODULES = ("nn", "optim", "debug", "experimental", "checkpoint")

__all__ = ["__version__", "Placement", "Shard", "Replicate", "Partial", *_LAZY, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"dtorch.{name}")  # (the import sets the attribute)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dtorch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
