"""DTorch worker: executes registered torch ops on local shards, one process per device."""

__version__ = "0.1.0"
