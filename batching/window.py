"""How long an idle worker waits for company before its first prefill.

Pure: no clock of its own (the caller passes ``now``), so it is tested on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mlxq.producer.validate import at_least


@dataclass(slots=True)
class Window:
    """The time window an idle worker holds open so early jobs share one prefill.

    Why: prefill runs the whole prompt through the model, and on the sizes mlxq
    serves one forward pass over N prompts costs far less than N passes (the
    weights are read once, the matmuls get wider). When the worker is idle and a
    first job arrives, it waits a moment for more, then prefills them together.

    The window never closes before ``window_s`` from the first arrival. A burst that
    is still coming in then keeps it open: jobs that arrive one request at a time (a
    gateway's burst of chat requests reaches Redis over tens of milliseconds) would
    otherwise split at the deadline into two prefill passes, and every row of the
    second waits out the first. So past ``window_s`` the window closes once no job has
    arrived for ``quiet_s`` (half of ``window_s``), and at ``longest_s`` from the
    first arrival in any case, so a steady trickle cannot hold the first job back for
    long. ``max_batch`` pending jobs close it at once: a full batch gains nothing from
    waiting.

    Recommended: ``window_s=0.020`` (20 ms, about one decode step of a small model, so
    a lone first job loses at most a token's worth of latency), ``longest_s=0.060``,
    with ``max_batch=32`` on CPU and ``64`` on a GPU, where a pass stays near
    memory-bound to larger batches. ``window_s=0`` disables the window;
    ``longest_s <= window_s`` gives a fixed window that arrivals never extend.

    Usage: ``open(now)`` on the first arrival while idle, ``arrived(now)`` whenever
    more jobs come; while not ``should_close(now, len(pending))``, block on the queue
    for at most ``remaining(now)`` seconds; then ``close()`` and prefill. ``now`` is any
    monotonic clock in seconds, e.g. ``time.monotonic()``.

    Args:
        window_s: Shortest wait in seconds after the first arrival; finite, >= 0.
        max_batch: Pending jobs that close the window early; >= 1.
        longest_s: Longest wait after the first arrival while jobs keep coming; None:
            ``window_s`` (fixed). Finite, >= 0; less than ``window_s`` counts as it.

    Raises:
        ValueError: naming the field and the bad value.
    """

    window_s: float
    max_batch: int
    longest_s: float | None = None
    opened_at: float | None = field(default=None, init=False)
    last_at: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.window_s = _seconds("window_s", self.window_s)
        at_least("max_batch", self.max_batch, 1)
        longest = self.window_s if self.longest_s is None else self.longest_s
        self.longest_s = max(self.window_s, _seconds("longest_s", longest))
        if self.window_s == 0:
            self.longest_s = 0.0

    @property
    def quiet_s(self) -> float:
        """The gap without arrivals that ends a burst (past ``window_s``)."""
        return self.window_s / 2

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def open(self, now: float) -> None:
        """Start the window at ``now``; a no-op when already open, so only ``arrived``
        (bounded by ``longest_s``) moves its end."""
        if self.opened_at is None:
            self.opened_at = self.last_at = now

    def arrived(self, now: float) -> None:
        """Jobs came at ``now``: a burst still coming in keeps the window open."""
        if self.opened_at is not None:
            self.last_at = max(self.last_at, now)

    def close(self) -> None:
        """End the window (the batch is going to prefill)."""
        self.opened_at = None

    def remaining(self, now: float) -> float:
        """Seconds left to wait: in ``[0, longest_s]``; 0 when closed.

        Clamped both ways, so a clock read before ``open`` cannot stretch the wait.
        """
        if self.opened_at is None:
            return 0.0
        assert self.longest_s is not None
        end = max(self.opened_at + self.window_s, self.last_at + self.quiet_s)
        end = min(end, self.opened_at + self.longest_s)
        return min(self.longest_s, max(0.0, end - now))

    def should_close(self, now: float, pending_count: int) -> bool:
        """Whether to stop waiting and prefill: the window's end has passed, or
        ``pending_count`` fills a batch. A closed window never holds jobs back."""
        return pending_count >= self.max_batch or self.remaining(now) == 0.0


def _seconds(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name}={value!r}: must be a finite number of seconds >= 0")
    return float(value)
