from __future__ import annotations

import copy

import pytest

BASE = {
    "name": "tiny",
    "seed": 5,
    "cluster": {"device_types": {"a100": {"speed": 1.0, "memory_gb": 80}, "slow": {"speed": 0.5}},
                "nodes": [{"count": 2, "devices_per_node": 4, "device_type": "a100"}]},
    "workload": {"synthetic": {"jobs": 12, "arrival": {"rate_per_s": 0.2}, "size": {"choices": [1, 2, 4]},
                               "duration": {"dist": "exponential", "mean": 30}},
                 "steps_per_job": 6, "sync_every": 2},
    "heartbeat": {"interval_s": 1.0, "timeout_s": 4.0},
    "policy": {"name": "fifo"},  # (the tests of other policies say so)
}


@pytest.fixture
def base() -> dict:
    return copy.deepcopy(BASE)
