"""One line on stderr that a long wait rewrites in place (`\r`) and ends with its outcome: a mesh waiting in the
admission queue (`_admission.place`), a sync point waiting long for the workers or frozen (`session.sync`).
Nothing is written for a wait that never shows it."""

from __future__ import annotations

import sys
from typing import IO

WIDTH = 100


class Line:
    def __init__(self, out: IO[str] | None = None) -> None:
        self.out = out or sys.stderr
        self.shown = False

    def show(self, text: str) -> None:
        self.out.write("\r" + text.ljust(WIDTH))
        self.out.flush()
        self.shown = True

    def end(self, text: str) -> None:
        """The last word of a line shown, on a line of its own (later output starts on the next one)."""
        if self.shown:
            self.out.write("\r" + text.ljust(WIDTH) + "\n")
            self.out.flush()
