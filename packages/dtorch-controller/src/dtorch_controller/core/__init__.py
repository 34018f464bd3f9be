"""The sans-IO controller core: `ControllerCore(config).handle(now, event) -> [effects]`.

No I/O, no clock reads, no threads, no torch: the gRPC server and the simulator both drive it. From outside, read
it through the notices among its effects and `ControllerCore.view` (view.py); its layers are drawn in
docs/architecture.md and checked by `.importlinter`.
"""

from dtorch_controller.core import effects, events, timers
from dtorch_controller.core.config import Config
from dtorch_controller.core.controller import MAX_LOGICAL_PER_DEVICE, ControllerCore
from dtorch_controller.core.effects import Effect, Notice, Refusal, Reply, SendExecute, SetTimer
from dtorch_controller.core.events import Event
from dtorch_controller.core.ids import counter_ids, random_session_id
from dtorch_controller.core.policies import POLICIES, FifoPolicy, LasPolicy, Policy, PriorityPolicy, make_policy
from dtorch_controller.core.scheduler import Scheduler
from dtorch_controller.core.view import CoreView

__all__ = [
    "MAX_LOGICAL_PER_DEVICE", "POLICIES", "Config", "ControllerCore", "CoreView", "Effect", "Event", "FifoPolicy",
    "LasPolicy", "Notice", "Policy", "PriorityPolicy", "Refusal", "Reply", "Scheduler", "SendExecute", "SetTimer",
    "counter_ids", "effects", "events", "make_policy", "random_session_id", "timers",
]
