"""A watchdog for lab ranks: a rank that stops making progress ends with a clear error.

Some failures hang instead of raising (a DDP comm hook whose future never completes blocks
autograd with no timeout); the harness then learns where the rank stalled.

Example:
    >>> start(limit=600.0, result_path=Path("/tmp/rank0.json"))   # doctest: +SKIP
    >>> beat("training step 3")                                     # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

__all__ = ["Watchdog", "beat", "start"]


class Watchdog:
    """Ends the rank with a clear error when no progress is reported for ``limit`` seconds.

    Some failures hang instead of raising (a DDP comm hook whose future never completes
    blocks autograd with no timeout); the harness then learns where it stalled.
    """

    def __init__(self, limit: float, result_path: Path) -> None:
        self.limit, self.result_path = limit, result_path
        self.phase, self.last = "start-up", time.monotonic()
        threading.Thread(target=self._watch, name="hexagram-watchdog", daemon=True).start()

    def beat(self, phase: str) -> None:
        self.phase, self.last = phase, time.monotonic()

    def _watch(self) -> None:
        while time.monotonic() - self.last < self.limit:
            time.sleep(0.5)
        error = f"hung: no progress for {self.limit:.0f} s during {self.phase}"
        self.result_path.write_text(json.dumps({"error": error, "time": time.time(),
                                                "rank": int(os.environ.get("RANK", "0"))}))
        os._exit(4)


_WATCHDOG: Watchdog | None = None


def beat(phase: str) -> None:
    """Report progress (``phase`` names what runs next) to the watchdog, if any."""
    if _WATCHDOG is not None:
        _WATCHDOG.beat(phase)


def start(limit: float, result_path: Path) -> Watchdog:
    """Start this process's watchdog (``beat`` reports to it)."""
    global _WATCHDOG
    _WATCHDOG = Watchdog(limit, result_path)
    return _WATCHDOG
