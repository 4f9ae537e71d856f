"""Process liveness, for what outlives or watches another process (KV transports, tiers)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
