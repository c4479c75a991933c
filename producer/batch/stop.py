"""Stopping a sweep cleanly: signals become a flag the loop checks between steps, and
Redis calls retried through an outage give way to it."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

from mlxq.producer.connection import TRANSIENT, Outage, backoff
from mlxq.producer.errors import Interrupted as Interrupted

T = TypeVar("T")


class StopFlag:
    """SIGINT / SIGTERM set a flag the loop checks between steps; a second one aborts."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def is_set(self) -> bool:
        return self.event.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True as soon as a stop is asked for."""
        return self.event.wait(seconds)

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._on)

    def restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def _on(self, signum: int, frame: FrameType | None) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.signum = signum
        self.event.set()


def retry(do: Callable[[], T], outage: Outage, stop: StopFlag) -> T:
    """``do()`` until Redis answers, backing off while it is away.

    Raises:
        Interrupted: a stop was asked for meanwhile.
    """
    failures = 0
    while True:
        try:
            result = do()
        except TRANSIENT as e:
            outage.failed(e)
            failures += 1
            if stop.wait(backoff().compute(failures)):
                raise Interrupted from None
            continue
        outage.ok()
        return result
