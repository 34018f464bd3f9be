"""The wire protocol: message types (`messages`), gRPC plumbing (`wire`), torch value encoding (`values`).

Importing `dtorch.protocol` (or `dtorch.protocol.messages` / `.wire`) never imports torch.
"""

from dtorch.protocol.messages import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION"]
