"""Where the decode thread's time goes, by stage, each stage's own time only.

The decode loop and the engine wrap their stages (``with stages.on("prefill"):``); a stage
inside another counts for itself and not for the outer one, so the figures add up to the
thread's wall time without counting any of it twice. MLX is lazy: a stage that waits for
the device (a prefill's ``eval``, a decode step's read of its tokens) also holds whatever
device work was queued before it. ``mlxq info --json`` shows them as ``busy_ms`` and
Prometheus as ``mlxq_loop_seconds_total{stage=...}``: a benchmark that compares two runs
reads which stage grew.

``MLXQ_TRACE_STAGES=FILE`` in a worker's environment also writes each stage as it ends,
one JSON line (``t``: its start on the thread's clock, s; ``stage``; ``ms``: its own
time; and what the stage noted, such as a prefill pass's rows and key length): a
benchmark reads which passes were slow, not only which stage grew. Off by default.
``MLXQ_TRACE_SYNC=1`` beside it waits for the device at the end of every stage and
writes that wait as ``wait_ms`` (part of ``ms``): each pass's own device time, where MLX
would have overlapped it with the host's next stage (so the run is slower; for
attribution only). While tracing, a decode step's parts are written too, each
as it ends (:meth:`Stages.part`: the model pass's graph, the sampler's, the launch of its
kernels and the wait for the last step's tokens, ``"part": true``, inside their stage's
time, not taken from it, with the thread's CPU time in each as ``cpu_ms``), so a trace
says whether a slower step was the host's work, the device's, or time the thread spent
blocked (its other threads holding the interpreter's lock); untraced they are not timed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import IO, Any

#: The environment variable naming a file each ended stage is written to.
TRACE_ENV = "MLXQ_TRACE_STAGES"
#: The environment variable that makes each traced stage wait for the device as it ends.
SYNC_ENV = "MLXQ_TRACE_SYNC"
#: What :meth:`Stages.part` gives untraced (``nullcontext`` holds nothing: reusable).
_UNTIMED: AbstractContextManager[None] = nullcontext()


class Stages:
    """Milliseconds spent in each stage (exclusive of the stages nested in it)."""

    def __init__(
        self, trace: IO[str] | None = None, sync: Callable[[], None] | None = None
    ) -> None:
        self.ms: dict[str, float] = {}
        self._inner: list[float] = []  # per open stage: time its nested stages took
        self._trace = trace
        self._sync = sync if trace is not None else None
        self._notes: list[dict[str, Any]] = []  # per open stage, when tracing

    @classmethod
    def from_env(cls) -> Stages:
        """Stages that trace to the file ``MLXQ_TRACE_STAGES`` names, if it is set (and
        wait for the device at each stage's end if ``MLXQ_TRACE_SYNC=1``)."""
        path = os.environ.get(TRACE_ENV)
        if not path:
            return cls()
        sync = None
        if os.environ.get(SYNC_ENV) == "1":
            import mlx.core as mx

            sync = mx.synchronize
        return cls(open(path, "a", buffering=1 << 16), sync)

    def close(self) -> None:
        """Write out and close the trace (its last 64 KiB are buffered until then); later
        stages are timed but no longer traced."""
        trace, self._trace, self._sync = self._trace, None, None
        if trace is not None:
            trace.close()

    @property
    def tracing(self) -> bool:
        """Whether stages are written to a trace (so notes are worth building)."""
        return self._trace is not None

    def note(self, **fields: Any) -> None:
        """What the innermost open stage did (rows, shapes), for the trace; free when
        nothing is traced."""
        if self._trace is not None and self._notes:
            self._notes[-1].update(fields)

    @contextmanager
    def on(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        self._inner.append(0.0)
        if self._trace is not None:
            self._notes.append({})
        try:
            yield
        finally:
            if self._sync is not None:
                self._notes[-1]["wait_ms"] = self._wait_ms(self._sync)
            took = time.perf_counter() - start
            inner = self._inner.pop()
            if self._inner:
                self._inner[-1] += took
            own = 1000 * (took - inner)
            self.ms[stage] = self.ms.get(stage, 0.0) + own
            if self._trace is not None:
                line = {"t": round(start, 6), "stage": stage, "ms": round(own, 3)}
                self._trace.write(json.dumps(line | self._notes.pop()) + "\n")

    @staticmethod
    def _wait_ms(sync: Callable[[], None]) -> float:
        """Wait for the device; how long that took (ms)."""
        waited = time.perf_counter()
        sync()
        return round(1000 * (time.perf_counter() - waited), 3)

    def part(self, name: str) -> AbstractContextManager[None]:
        """A part of the open stage, written to the trace as it ends; nothing untraced
        (one shared no-op: a decode step enters four). Its time stays the stage's own
        (``busy_ms`` and the stage's line are whole)."""
        return self._part(name) if self._trace is not None else _UNTIMED

    @contextmanager
    def _part(self, name: str) -> Iterator[None]:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            line: dict[str, Any] = {"t": round(start, 6), "stage": name, "part": True}
            if self._sync is not None:
                line["wait_ms"] = self._wait_ms(self._sync)
            line["ms"] = round(1000 * (time.perf_counter() - start), 3)
            # This thread's CPU time in the part: the rest it spent blocked, waiting for
            # the interpreter's lock (MLX gives it up while it launches) or on a lock of
            # MLX's own (on an H100, 0.04-0.06 ms a part at the mean: docs/benchmarks.md).
            line["cpu_ms"] = round(1000 * (time.thread_time() - cpu), 3)
            if self._trace is not None:
                self._trace.write(json.dumps(line) + "\n")

    def since(self, before: dict[str, float]) -> dict[str, float]:
        """Each stage's milliseconds since ``before`` (a copy of :attr:`ms`), the longest
        first, the stages that took none left out."""
        grown = {k: v - before.get(k, 0.0) for k, v in self.ms.items()}
        return dict(sorted(((k, v) for k, v in grown.items() if v > 0), key=lambda kv: -kv[1]))

    def snapshot(self) -> dict[str, float]:
        """Each stage's milliseconds so far, rounded to microseconds."""
        return {k: round(v, 3) for k, v in sorted(self.ms.copy().items())}
