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
    The wait is bounded twice: by ``window_s`` from the first arrival, which
    later arrivals never extend, and by ``max_batch`` pending jobs, since a full
    batch gains nothing from waiting.

    Recommended: ``window_s=0.020`` (20 ms, about one decode step of a small
    model, so the first job loses at most a token's worth of latency) with
    ``max_batch=32`` on CPU and ``64`` on a GPU, where a pass stays near
    memory-bound to larger batches. ``window_s=0`` disables the window.

    Usage: ``open(now)`` on the first arrival while idle; while not
    ``should_close(now, len(pending))``, block on the queue for at most
    ``remaining(now)`` seconds; then ``close()`` and prefill. ``now`` is any
    monotonic clock in seconds, e.g. ``time.monotonic()``.

    Args:
        window_s: Longest wait in seconds after the first arrival; finite, >= 0.
        max_batch: Pending jobs that close the window early; >= 1.

    Raises:
        ValueError: naming the field and the bad value.
    """

    window_s: float
    max_batch: int
    opened_at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        w = self.window_s
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"window_s={w!r}: must be a finite number of seconds >= 0")
        self.window_s = float(w)
        at_least("max_batch", self.max_batch, 1)

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def open(self, now: float) -> None:
        """Start the window at ``now``; a no-op when already open, so a steady
        trickle of arrivals cannot hold the first job back forever."""
        if self.opened_at is None:
            self.opened_at = now

    def close(self) -> None:
        """End the window (the batch is going to prefill)."""
        self.opened_at = None

    def remaining(self, now: float) -> float:
        """Seconds left to wait: in ``[0, window_s]``; 0 when closed.

        Clamped both ways, so a clock read before ``open`` cannot stretch the wait.
        """
        if self.opened_at is None:
            return 0.0
        return min(self.window_s, max(0.0, self.opened_at + self.window_s - now))

    def should_close(self, now: float, pending_count: int) -> bool:
        """Whether to stop waiting and prefill: the deadline has passed, or
        ``pending_count`` fills a batch. A closed window never holds jobs back."""
        return pending_count >= self.max_batch or self.remaining(now) == 0.0
