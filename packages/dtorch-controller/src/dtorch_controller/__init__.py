"""DTorch controller: sans-IO cluster core (`core`) and the gRPC server that drives it (`server`)."""

__version__ = "0.1.0"
