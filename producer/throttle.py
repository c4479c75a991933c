"""Rate-limited warnings: a loop that meets the same bad key every second, or a flood of
bad keys at once, logs a few lines a minute, not one per meeting.

A :class:`Throttle` is a ``warn(message)`` callable: each distinct message passes once per
period, at most :data:`MAX_LINES` messages pass per period in all (the rest are counted
and summed up in one line when the next period opens), and each is cut to
:data:`MAX_CHARS`, since a message may quote what a key held.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

#: Seconds before the same message is told again.
PERIOD_S = 60.0
#: Most lines one period tells (distinct messages beyond it are only counted).
MAX_LINES = 50
#: Longest message told; longer ones are cut, with a mark.
MAX_CHARS = 400
#: Distinct messages remembered (the oldest are forgotten first).
REMEMBERED = 1024


def cut(text: str, limit: int = MAX_CHARS) -> str:
    """``text``, or its first ``limit`` characters and how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more chars)"


class Throttle:
    """Passes ``message`` to ``emit`` unless told recently or too much was told already.

    Args:
        emit: Where a message that passes goes (``log.warning``, a print to stderr).
        period_s: The window of both limits, in seconds.
        max_lines: Most messages one window passes.

    Thread-safe: the gateway warns from its worker threads.
    """

    def __init__(
        self, emit: Callable[[str], None], period_s: float = PERIOD_S, max_lines: int = MAX_LINES
    ) -> None:
        self._emit, self.period_s, self.max_lines = emit, period_s, max_lines
        self._told: OrderedDict[str, float] = OrderedDict()
        self._window, self._lines, self._held = time.monotonic(), 0, 0
        self._lock = threading.Lock()

    def __call__(self, message: str) -> None:
        message = cut(message)
        with self._lock:
            now = time.monotonic()
            summary = self._roll(now)
            last = self._told.get(message)
            fresh = last is None or now - last >= self.period_s
            passes = fresh and self._lines < self.max_lines
            if passes:
                self._lines += 1
                self._told[message] = now
                self._told.move_to_end(message)
                while len(self._told) > REMEMBERED:
                    self._told.popitem(last=False)
            elif fresh:
                self._held += 1
        if summary:
            self._emit(summary)
        if passes:
            self._emit(message)

    def flush(self) -> None:
        """Tell how many messages were held back so far, if any (a one-shot reader's end)."""
        with self._lock:
            held, self._held = self._held, 0
        if held:
            self._emit(f"{held} more warnings were not shown")

    def _roll(self, now: float) -> str | None:
        """Open a new window when the last one is over; what it held back, if anything."""
        if now - self._window < self.period_s:
            return None
        held, self._window, self._lines, self._held = self._held, now, 0, 0
        return (
            f"{held} more warnings were not shown in the last {self.period_s:g} s" if held else None
        )
