"""What the worker's helper threads share: a daemon thread that runs one turn after
another until stopped, rides out a Redis outage with backoff (its start and end logged
once), and outlives any other error a turn hits.

The helpers are the cancel listener (:mod:`mlxq.worker.cancels`), the heartbeat
(:mod:`mlxq.worker.liveness`) and the prefetcher (:mod:`mlxq.worker.prefetch`); the
writer (:mod:`mlxq.worker.sink`) retries each write in order instead, and is not one.
"""

from __future__ import annotations

import logging
import threading

from mlxq.producer.connection import TRANSIENT, Outage, backoff

log = logging.getLogger("mlxq.worker")


class Helper:
    """One helper thread; a subclass says what one :meth:`_turn` does.

    Args:
        name: The thread's name.
        what: What the logs call it.
        join_s: How long :meth:`stop` waits for the thread to end.
    """

    #: The pause after an unexpected error, before the next turn.
    error_wait_s = 0.2

    def __init__(self, name: str, what: str, join_s: float) -> None:
        self.what, self.join_s = what, join_s
        self._stop = threading.Event()
        self._outage = Outage(log, what)
        self._failures = 0  # outages in a row, for the backoff
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait (up to ``join_s``) for it to end."""
        self._stop.set()
        self._wake()
        self._thread.join(self.join_s)

    def _wake(self) -> None:
        """Cut short what a turn may wait on besides the stop event."""

    def _turn(self) -> None:
        raise NotImplementedError

    def _ok(self) -> None:
        """Redis answered: an outage, if any, is over."""
        self._outage.ok()
        self._failures = 0

    def _on_outage(self) -> None:
        """A turn failed for Redis: wait the backoff before the next."""
        self._stop.wait(backoff().compute(self._failures))

    def _on_error(self, error: Exception) -> None:
        """A turn hit something else: say so, pause, go on."""
        log.exception("%s: going on after an unexpected error", self.what)
        self._stop.wait(self.error_wait_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._turn()
                self._ok()
            except TRANSIENT as e:
                self._outage.failed(e)
                self._failures += 1
                self._on_outage()
            except Exception as e:  # this thread must outlive whatever one turn hits
                self._on_error(e)
