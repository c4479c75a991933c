"""Progress on stderr while a sweep runs, and its summary at the end.

On a terminal, a tqdm bar (done/total, rate, ETA) with failures and tok/s beside it;
otherwise (a log file, CI) one plain line every ``every_s`` seconds.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any

from tqdm import tqdm

PREFIX = "mlxq run-batch"
BAR_REFRESH_S = 0.5


@dataclass
class Tally:
    """What a run did so far.

    Attributes:
        total: Input lines that are not blank; None for a stream (not counted).
        earlier: Of those, lines answered (or reported) by earlier runs.
        answered: Output lines this run wrote, failures included.
        failed: Of those, jobs that failed (or were canceled) in the worker.
        invalid: Input lines this run reported as unrunnable.
        prompt_tokens: Over the requests this run answered.
        completion_tokens: Over the requests this run answered.
    """

    total: int | None = 0
    earlier: int = 0
    answered: int = 0
    failed: int = 0
    invalid: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> int:
        n = self.earlier + self.answered + self.invalid
        return n if self.total is None else min(self.total, n)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def tok_s(self) -> float:
        return self.completion_tokens / self.elapsed if self.elapsed > 0 else 0.0

    def eta_s(self) -> float | None:
        made = self.answered + self.invalid
        if not made or self.elapsed <= 0 or self.total is None:
            return None
        return max(0, self.total - self.done) * self.elapsed / made


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """Shows a :class:`Tally` as it changes.

    Args:
        tally: The run's counts (read on every :meth:`show`).
        mode: ``"bar"``, ``"plain"`` or ``"off"``; ``"auto"`` picks bar on a terminal.
        every_s: Seconds between plain lines.
        stream: Where it goes (stderr).
    """

    def __init__(
        self, tally: Tally, mode: str = "auto", every_s: float = 10.0, stream: IO[str] | None = None
    ) -> None:
        self.tally, self.every_s = tally, every_s
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "plain"
        if mode not in ("bar", "plain", "off"):
            raise ValueError(f"mode={mode!r}: must be auto, bar, plain or off")
        self.mode = mode
        self._last = time.monotonic()
        self.bar: Any = None
        if mode == "bar":
            self.bar = tqdm(
                total=tally.total,
                initial=tally.done,
                unit="req",
                desc=PREFIX,
                file=self.stream,
                dynamic_ncols=True,
                smoothing=0.1,
            )

    def show(self) -> None:
        t = self.tally
        if self.bar is not None:
            if t.done > self.bar.n:
                self.bar.update(t.done - self.bar.n)
            self.bar.set_postfix_str(
                f"failed={t.failed} invalid={t.invalid} {t.tok_s():.0f} tok/s", refresh=False
            )
            if time.monotonic() - self._last >= BAR_REFRESH_S:  # the clock ticks between ends
                self._last = time.monotonic()
                self.bar.refresh()
        elif self.mode == "plain" and time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            print(f"{PREFIX}: {self.line()}", file=self.stream, flush=True)

    def line(self) -> str:
        t = self.tally
        rest = f"{t.failed} failed, {t.invalid} invalid, {t.tok_s():.0f} tok/s"
        if t.total is None:  # a stream: no total to measure against
            return f"{t.done} done, {rest}"
        pct = 100.0 * t.done / t.total if t.total else 100.0
        return f"{t.done}/{t.total} done ({pct:.0f}%), {rest}, ETA {_clock(t.eta_s())}"

    def close(self) -> None:
        if self.bar is not None:
            self.show()
            self.bar.refresh()
            self.bar.close()
            self.bar = None


def summary(t: Tally) -> str:
    """The closing lines: requests, failures, tokens, wall time, tok/s."""
    ok = t.answered - t.failed
    text = f"{t.answered} requests answered ({ok} ok, {t.failed} failed), {t.invalid} invalid lines"
    if t.earlier:
        text += f"; {t.earlier} done by earlier runs"
    text += (
        f"\n{PREFIX}: {t.completion_tokens} completion tokens "
        f"({t.prompt_tokens} prompt) in {t.elapsed:.1f} s: {t.tok_s():.1f} tok/s, "
        f"{t.answered / t.elapsed if t.elapsed > 0 else 0.0:.2f} req/s"
    )
    return text
