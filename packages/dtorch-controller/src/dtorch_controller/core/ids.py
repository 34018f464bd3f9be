"""Session id generators: randomness is input, so the core takes it from the adapter.

The server uses `random_session_id` (unguessable: naming a session is the right to its tensors);
tests and the simulator use `counter_ids` so runs are reproducible.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable


def random_session_id() -> str:
    return secrets.token_hex(16)


def counter_ids(prefix: str = "s") -> Callable[[], str]:
    """Deterministic ids "s1", "s2", ... (for tests and simulations only)."""
    counter = itertools.count(1)
    return lambda: f"{prefix}{next(counter)}"
