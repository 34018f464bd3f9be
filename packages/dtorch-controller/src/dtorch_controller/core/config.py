"""Tunables of the controller core; the adapters (server, simulator) build one and pass it in."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from string import Template


class ConfigError(ValueError):
    """A setting out of its range. The message names fields as `$field` (`Template`): str() gives the fields' own
    names, `render(names)` the adapter's (`dtorch-controller` says `--heartbeat-interval`, not
    `heartbeat_interval_s`)."""

    def __init__(self, template: str) -> None:
        self.template = Template(template)
        super().__init__(self.render({}))

    def render(self, names: Mapping[str, str]) -> str:
        return self.template.substitute({f.name: names.get(f.name, f.name) for f in fields(Config)})


MIN_HEARTBEAT_INTERVAL_S = 0.01  # a worker reports at most this often, whatever it is told (dtorch_worker.agent)
# a shorter one closed every session at once, its client told to keep it alive every timeout / 4 (a busy loop)
MIN_SESSION_TIMEOUT_S = 0.1


def format_seconds(t: float) -> str:
    """Default event-log time stamp: the core's own clock, in seconds (the server swaps in wall-clock time)."""
    return f"{t:.3f}"


@dataclass(frozen=True)
class Config:
    """Heartbeat deadlines, client liveness and bookkeeping sizes.

    A worker silent for `suspect_after_s` (two heartbeat intervals, capped by the timeout) becomes suspect,
    and lost at `heartbeat_timeout_s`, so a dead worker is detected within the timeout.
    """

    heartbeat_interval_s: float = 0.2
    heartbeat_timeout_s: float = 1.0
    event_log_size: int = 200  # recent events kept for Status
    lost_workers_kept: int = 32  # lost workers still listed in Status once nothing refers to them
    max_sync_timeout_s: float = 3600.0  # clamp on a client's Sync timeout
    # Recovery (recovery.py): every live shard of a session is copied (on its worker and in another worker's
    # host memory) after this many batches, or at the next batch once this old; batches since then are
    # replayed after a worker loss. 0 batches: no copies, a lost worker's tensors are lost.
    snapshot_every_batches: int = 32
    snapshot_every_s: float = 30.0
    session_timeout_s: float = 5.0  # a client silent this long is gone: its session closes (0: never)
    collective_timeout_s: float = 60.0  # bound on a process group's rendezvous and on each of its collectives
    # Pipeline rule 7: at most this many Execute batches of a session sent and not completed on any one worker (the
    # rest wait in its log), so a freeze takes effect within that many batches; 0: no bound (everything goes out).
    dispatch_ahead: int = 0
    format_time: Callable[[float], str] = format_seconds  # renders `now` in event-log lines

    def __post_init__(self) -> None:
        if not self.heartbeat_interval_s >= MIN_HEARTBEAT_INTERVAL_S:  # a shorter one only made workers look suspect
            raise ConfigError(f"$heartbeat_interval_s must be >= {MIN_HEARTBEAT_INTERVAL_S} s (workers report at most "
                              f"that often), got {self.heartbeat_interval_s}")
        if not self.heartbeat_timeout_s > self.heartbeat_interval_s:
            raise ConfigError(f"$heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed $heartbeat_interval_s "
                              f"({self.heartbeat_interval_s})")
        if not (self.session_timeout_s == 0 or self.session_timeout_s >= MIN_SESSION_TIMEOUT_S):
            raise ConfigError(f"$session_timeout_s must be 0 (never) or >= {MIN_SESSION_TIMEOUT_S} s, got "
                              f"{self.session_timeout_s}")
        if self.snapshot_every_batches < 0 or not self.snapshot_every_s > 0:
            raise ConfigError(f"$snapshot_every_batches must be >= 0 and $snapshot_every_s > 0, got "
                              f"{self.snapshot_every_batches} and {self.snapshot_every_s}")
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"$collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if self.dispatch_ahead < 0:
            raise ConfigError(f"$dispatch_ahead must be >= 0, got {self.dispatch_ahead}")
        if self.event_log_size < 1:
            raise ConfigError(f"$event_log_size must be >= 1, got {self.event_log_size}")

    @property
    def suspect_after_s(self) -> float:
        return min(2 * self.heartbeat_interval_s, self.heartbeat_timeout_s)
