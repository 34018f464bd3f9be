"""The DTorch wire protocol, shared by client, controller, workers and simulator; never imports torch.

* `messages`: every message type (msgspec Structs), the single source of truth for the wire;
* `wire`: gRPC plumbing (service tables, validation on receipt, authentication metadata);
* `values`: torch values inside op arguments (torch is imported only when one of its functions runs);
* `placement_types`, `layout`: placements and where each device's shard sits (pure index arithmetic).
"""

from dtorch_protocol._version import __version__
from dtorch_protocol.messages import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "__version__"]
