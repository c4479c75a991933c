"""Where the decode thread's time goes, by stage, each stage's own time only.

The decode loop and the engine wrap their stages (``with stages.on("prefill"):``); a stage
inside another counts for itself and not for the outer one, so the figures add up to the
thread's wall time without counting any of it twice. MLX is lazy: a stage that waits for
the device (a prefill's ``eval``, a decode step's read of its tokens) also holds whatever
device work was queued before it. ``mlxq info --json`` shows them as ``busy_ms`` and
Prometheus as ``mlxq_loop_seconds_total{stage=...}``: a benchmark that compares two runs
reads which stage grew.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Stages:
    """Milliseconds spent in each stage (exclusive of the stages nested in it)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._inner: list[float] = []  # per open stage: time its nested stages took

    @contextmanager
    def on(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            took = time.perf_counter() - start
            inner = self._inner.pop()
            if self._inner:
                self._inner[-1] += took
            self.ms[stage] = self.ms.get(stage, 0.0) + 1000 * (took - inner)

    def snapshot(self) -> dict[str, float]:
        """Each stage's milliseconds so far, rounded to microseconds."""
        return {k: round(v, 3) for k, v in sorted(self.ms.copy().items())}
