"""Several queues by priority: the levels a worker serves, and whose job gets a free row.

``mlxq worker --queue chat --queue team-a:3,team-b:1 --queue sweeps``: each ``--queue`` is
one level, the first the highest (rq's convention). One value may name several queues
joined by commas; they share that level and split its rows by weight (1 when left out).

Pure decisions, as the rest of this package: :class:`Levels` reads the option,
:class:`Shares` picks the queue whose job takes the next free row (the highest level with
a job waiting; within it the queue furthest behind its weighted share of decoded tokens:
deficit round robin counted in tokens), and :func:`to_pause` names the running jobs to
pause so that waiting jobs of a strictly higher level get rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from mlxq.producer.validate import bad


@dataclass(frozen=True, slots=True)
class Share:
    """One queue of a level and its weight."""

    queue: str
    weight: int = 1


@dataclass(frozen=True, slots=True)
class Levels:
    """The levels a worker serves, highest first, each one or more weighted queues."""

    levels: tuple[tuple[Share, ...], ...]

    @classmethod
    def parse(cls, values: Sequence[str]) -> Levels:
        """Read ``--queue`` values (or ``MLXQ_QUEUES``'s, split on spaces), one level each.

        Raises:
            PayloadError: naming the value: an empty name, a weight that is not a whole
                number >= 1, a queue named twice, or no queue at all.
        """
        if not values:
            raise bad("queue", list(values), "name at least one queue")
        seen: set[str] = set()
        levels = []
        for value in values:
            level = tuple(_share(part, value) for part in value.split(","))
            for s in level:
                if s.queue in seen:
                    raise bad("queue", value, f"queue {s.queue!r} is named twice")
                seen.add(s.queue)
            levels.append(level)
        return cls(tuple(levels))

    @property
    def queues(self) -> tuple[str, ...]:
        """Every queue, highest level first, in the order given."""
        return tuple(s.queue for level in self.levels for s in level)

    def level_of(self, queue: str) -> int:
        """A queue's level: 0 is the highest."""
        for i, level in enumerate(self.levels):
            if any(s.queue == queue for s in level):
                return i
        raise KeyError(queue)


def _share(part: str, value: str) -> Share:
    name, sep, weight = part.strip().partition(":")
    if not name or any(c.isspace() for c in name):
        raise bad("queue", value, "each queue needs a name without spaces")
    if not sep:
        return Share(name)
    if not weight.isdigit() or int(weight) < 1:
        raise bad("queue", value, f"weight {weight!r} of {name!r} must be a whole number >= 1")
    return Share(name, int(weight))


class Shares:
    """Which queue's job takes the next free row, and what each queue was served.

    Args:
        levels: The worker's levels.
    """

    def __init__(self, levels: Levels) -> None:
        self.levels = levels
        self._weight = {s.queue: s.weight for level in levels.levels for s in level}
        self._level = {q: levels.level_of(q) for q in self._weight}
        self._order = {q: i for i, q in enumerate(levels.queues)}
        self._served: dict[str, float] = dict.fromkeys(self._weight, 0.0)  # tokens / weight
        # Each level's virtual time: what the queue it last picked had been served. A queue
        # that comes back to a level starts no lower (start-time fair queueing).
        self._clock = [0.0] * len(levels.levels)
        self._waited: set[str] = set()  # the queues with a job waiting at the last pick

    def charge(self, queue: str, tokens: int) -> None:
        """A queue's jobs decoded ``tokens`` more tokens."""
        self._served[queue] += tokens / self._weight[queue]

    def pick(self, waiting: Iterable[str]) -> str | None:
        """The queue whose oldest waiting job takes the next free row: the highest level
        with a job waiting, and in it the queue least served for its weight (ties: the
        order given). None when nothing waits."""
        queues = [q for q in dict.fromkeys(waiting) if q in self._weight]
        if not queues:
            return None
        top = min(self._level[q] for q in queues)
        rivals = [q for q in queues if self._level[q] == top]
        # A queue that had nothing waiting at the last pick is owed no backlog of rows for
        # its idle time, nor does it owe any for the rows it took before: it comes back at
        # its level's virtual time. (Measured against the rivals waiting now instead, the
        # first queue back after the whole level idled kept the deficit of its last busy
        # spell, and took every row for seconds.)
        for q in rivals:
            if q not in self._waited:
                self._served[q] = max(self._served[q], self._clock[top])
        self._waited = set(queues)
        pick = min(rivals, key=lambda q: (self._served[q], self._order[q]))
        self._clock[top] = self._served[pick]
        return pick


@dataclass(frozen=True, slots=True)
class Running:
    """What :func:`to_pause` reads of a running job."""

    job_id: str
    level: int
    started: float  # when it started (any clock, the later the younger)
    pauses: int


def to_pause(
    waiting: Mapping[int, int], running: Sequence[Running], free: int, max_pauses: int
) -> list[str]:
    """The running jobs to pause so that waiting jobs of higher levels get rows.

    Args:
        waiting: Jobs waiting, by level (0 the highest).
        running: The jobs in the batch.
        free: Rows free now (they go to waiting jobs first).
        max_pauses: A job paused this many times is not paused again (nothing churns).

    Returns:
        Job ids, at most one per waiting job that finds no free row: for each such job,
        highest level first, the youngest job of the lowest level running, only when that
        level is strictly lower than the waiting job's.
    """
    candidates = sorted(
        (r for r in running if r.pauses < max_pauses),
        key=lambda r: (r.level, r.started),
    )
    out: list[str] = []
    for level in sorted(waiting):
        for _ in range(waiting[level]):
            if free > 0:
                free -= 1
                continue
            if not candidates or candidates[-1].level <= level:
                return out
            out.append(candidates.pop().job_id)
    return out
