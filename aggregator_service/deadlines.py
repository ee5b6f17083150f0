"""Deadlines: the ticker thread that applies round deadlines and secure-aggregation phase deadlines.

:meth:`RoundTicker.tick` looks at every open round of a running task under the engine's lock: a passed
deadline goes to the round machine (close with quorum, reopen, or fail), then the secure-aggregation
coordinator applies its join and phase deadlines; it returns how long to sleep until the next deadline (at most
1 s). The thread waits on the engine's condition variable between ticks, so a change wakes it early; an error
in a tick is logged and the ticker goes on (deadlines must stay alive).
"""

from __future__ import annotations

import threading
from typing import Callable

import structlog

from aggregator_service.rounds import RoundMachine
from aggregator_service.store import Store, now_ms

log = structlog.get_logger("fedclinic.aggregator.engine")


class RoundTicker:
    """Applies deadlines (module docstring); ``secagg_tick`` returns seconds until its next deadline."""

    def __init__(self, store: Store, rounds: RoundMachine, secagg_tick: Callable[[], float],
                 changed: threading.Condition) -> None:
        self.store = store
        self.rounds = rounds
        self._secagg_tick = secagg_tick
        self.changed = changed
        self._stopping = False
        self._thread: threading.Thread | None = None

    def tick(self) -> float:
        """Apply deadlines; returns seconds until the next deadline (capped at 1 s, at least 0.01 s)."""
        wait = 1.0
        with self.changed:
            now = now_ms()
            for rnd in self.store.open_rounds():
                if now < rnd.deadline_ms:
                    wait = min(wait, (rnd.deadline_ms - now) / 1000)
                    continue
                self.rounds.deadline_passed(rnd)
            wait = min(wait, self._secagg_tick())
            self.changed.notify_all()
        return max(wait, 0.01)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="round-ticker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (the caller has set the engine's stopping flag and notified the condition)."""
        with self.changed:
            self._stopping = True
            self.changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stopping:
            try:
                wait = self.tick()
            except Exception:  # keep deadlines alive whatever happens; the error is logged
                log.exception("round ticker failed")
                wait = 1.0
            with self.changed:
                if not self._stopping:
                    self.changed.wait(wait)
