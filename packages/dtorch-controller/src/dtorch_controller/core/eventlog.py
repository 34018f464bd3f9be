"""The bounded ring of recent events that Status shows: what happened, when, in one line each."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class EventLog:
    def __init__(self, size: int, format_time: Callable[[float], str]) -> None:
        self._lines: deque[str] = deque(maxlen=size)
        self._format_time = format_time

    def add(self, now: float, text: str) -> None:
        self._lines.append(f"{self._format_time(now)} {text}")

    def lines(self) -> list[str]:
        return list(self._lines)
