"""FIFO: first come, first served, strictly; no preemption, no packing.

Every session has the same rank, so a request that cannot be placed holds back every later one
(head-of-line blocking, the classic baseline). Devices are leased whole, one session each.
"""

from __future__ import annotations

from dtorch_controller.core.policies.base import BasePolicy


class FifoPolicy(BasePolicy):
    name = "fifo"
