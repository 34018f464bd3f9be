"""The sans-IO controller core: `ControllerCore(config).handle(now, event) -> [effects]`.

No I/O, no clock reads, no threads, no torch: the gRPC server and the simulator both drive it.
"""

from dtorch_controller.core import effects, events
from dtorch_controller.core.config import Config
from dtorch_controller.core.controller import ControllerCore
from dtorch_controller.core.effects import Effect, Refusal, Reply, SendExecute, SetTimer
from dtorch_controller.core.events import Event
from dtorch_controller.core.ids import counter_ids, random_session_id
from dtorch_controller.core.scheduling import FifoPlacement, PlacementDecision, PlacementPolicy, PlacementRequest

__all__ = [
    "Config", "ControllerCore", "Effect", "Event", "FifoPlacement", "PlacementDecision", "PlacementPolicy",
    "PlacementRequest", "Refusal", "Reply", "SendExecute", "SetTimer", "counter_ids", "effects", "events",
    "random_session_id",
]
