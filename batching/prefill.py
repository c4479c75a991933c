"""How new rows go into a decoding batch: in fewer prefills, of shapes that repeat.

Pure: plain numbers in, decisions out (the caller passes the step), so both rules are
tested on their own.

Why. mlx-lm's continuous batch takes new rows in with passes of their own, one over their
prompts and one for their first token, while every decoding row waits; and on a GPU each
new (rows, length) shape of a prefill may cost a kernel build or an attention plan (MLX's
CUDA backend keys its cuDNN attention graphs by exact shapes). Jobs that reach a worker
one HTTP request at a time start a few per decode step, in cohorts; jobs of one length
then end cohort by cohort, and a deep queue refills each cohort's rows with a prefill of
its own, every round, for as long as the queue lasts. A batch fed by one call starts
(and so refills) all its rows at once.

:class:`Gather` lets the rows a cohort frees wait a few steps for the next cohort's, when
that one is about to end, so the two refill in one prefill and run as one cohort from
then on; :func:`prefill_shape` rounds a prefill's rows and length up to a few buckets, so
the shapes repeat and their plans are reused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mlxq.producer.validate import at_least

#: What a refill costs, in decode steps of the whole batch: mlx-lm's two passes of its own
#: (prompt, first token) while every decoding row waits; on a GPU a pass of a few rows
#: costs about what a decode step of all of them does. (Rows that ride take no first-token
#: pass, but a sweep's prefill of many rows costs more than a step: two stays the estimate.)
PASS_STEPS = 2


@dataclass(slots=True)
class Gather:
    """Whether free rows take waiting jobs now, or wait for rows about to end to join them.

    Rule, each decode step with ``n = min(free rows, waiting jobs) > 0``: wait when more
    jobs wait than rows are free (a queue that would fill rows freed later), some running
    row ends within ``d`` steps for sure (its ``max_tokens`` run out; it may end sooner),
    waiting costs no more than the refill it saves (the rows' idle steps so far plus ``n *
    d`` at most :data:`PASS_STEPS` times the rows a refill would stall, ``running + n``),
    and admission has not been put off ``hold_steps`` steps already. Otherwise admit. So
    nothing waits on an idle batch, nor without a queue behind it, nor for rows that might
    run on; a job waits at most ``hold_steps`` decode steps more than it would without the
    rule; and rows stand idle for a refill no longer than that refill would cost (as in
    ski rental: rent until the rent paid would have bought the skis). One row freed early
    may so wait a long while for a cohort about to end; many rows, a step or two.

    Recommended: ``hold_steps=4``, which joins cohorts that started up to four steps
    apart (a gateway's burst reaches a worker over a few steps); 0 turns the rule off.

    Usage: once per decode step, ``ready(step, free, waiting, steps_left)``, where
    ``steps_left()`` gives each running row's most decode steps still to run; admit
    when True. ``steps_left`` is called only when there is something to decide.

    Args:
        hold_steps: Most decode steps admission is put off; >= 0.

    Raises:
        ValueError: naming the field and the bad value.
    """

    hold_steps: int
    #: The step admission was first put off, None while nothing waits for a row.
    since: int | None = field(default=None, init=False)
    #: Row-steps the rows have stood idle since then.
    idle: int = field(default=0, init=False)
    #: Decode steps on which admission was put off, since the start.
    held_steps: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        at_least("hold_steps", self.hold_steps, 0)

    def ready(
        self,
        step: int,
        free: int,
        waiting: int,
        steps_left: Callable[[], Sequence[int]],
        hold_steps: int | None = None,
    ) -> bool:
        """Whether to admit the waiting jobs at ``step`` (a decode-step counter);
        ``hold_steps`` for this decision instead of the rule's own (a sweep's level)."""
        hold = self.hold_steps if hold_steps is None else hold_steps
        n = min(free, waiting)
        if n > 0 and hold > 0 and waiting > free:
            if self.since is None:
                self.since, self.idle = step, 0
            budget = hold - (step - self.since)
            rows = steps_left()
            soon = min(rows, default=budget + 1)
            if 0 < soon <= budget and self.idle + n * soon <= PASS_STEPS * (len(rows) + n):
                self.idle += n
                self.held_steps += 1
                return False
        self.since = None
        return n > 0


def bucket(n: int, floor: int, per_octave: int) -> int:
    """The smallest bucket >= ``n``: ``floor`` and below is one bucket; above it,
    ``per_octave`` (a power of two) evenly spaced sizes in every doubling (2: ..., 16, 24,
    32, 48, ...; 4: ..., 32, 40, 48, 56, 64, ...). Past ``floor`` a bucket is less than
    ``n * (1 + 1 / per_octave)``."""
    at_least("n", n, 0)
    if n <= floor:
        return floor
    octave = 1 << ((n - 1).bit_length() - 1)  # the largest power of two below n
    step = max(1, octave // per_octave)
    return math.ceil(n / step) * step


def prefill_shape(rows: int, length: int, max_rows: int, max_length: int) -> tuple[int, int]:
    """The padded shape of a prefill of ``rows`` prompts, the longest ``length`` tokens.

    Rows round up to 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, ... (at most half again as
    many: a short prefill's cost hardly grows with its rows), lengths to 16, then four
    sizes an octave (at most a quarter longer: a long prefill's cost grows with its
    tokens); neither past its cap (``max_rows``, ``max_length``), nor below what it holds.

    Args:
        rows: Prompts in the pass, >= 1.
        length: Tokens of the longest, >= 1.
        max_rows: Rows a pass may hold (the batch's size).
        max_length: Tokens a pass may hold (the prefill step).

    Raises:
        ValueError: naming the field and the bad value.
    """
    at_least("rows", rows, 1)
    at_least("length", length, 1)
    r = max(rows, min(bucket(rows, 1, 2), max_rows))
    n = max(length, min(bucket(length, 16, 4), max_length))
    return r, n
