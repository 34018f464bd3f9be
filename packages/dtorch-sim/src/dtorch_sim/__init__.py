"""DTorch simulator: drives the real controller core with simulated workers on a simpy clock."""

__version__ = "0.1.0"
