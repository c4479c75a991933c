"""What the worker's helper threads tell the decode loop: one frozen type per message.

The decode thread owns every :class:`~mlxq.worker.jobs.Job`; the other threads never touch
one. They put these on the loop's :data:`Inbox`, and the loop handles them with ``match``
at the top of each turn (:meth:`mlxq.worker.loop.DecodeLoop._handle_inbox`).

- the writer (:mod:`mlxq.worker.sink`): :class:`Started`, :class:`Ended`,
  :class:`Settled`, :class:`WriteFailed`;
- the cancel listener and the heartbeat: :class:`CancelRequested`;
- the heartbeat (:mod:`mlxq.worker.liveness`): :class:`Reaped`, :class:`Suspended`,
  :class:`MasterChanged`.
"""

from __future__ import annotations

import queue
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from mlxq.producer.outcome import Outcome


@dataclass(frozen=True, slots=True)
class Started:
    """Start scripts' verdicts: ``ok``, or why a job must not run here (``canceled``,
    ``refused``: no longer this worker's)."""

    verdicts: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Ended:
    """Ends of running jobs, committed (or refused: the job was no longer ours)."""

    outcomes: Mapping[str, Outcome]


@dataclass(frozen=True, slots=True)
class Settled:
    """Jobs let go of before they ran: failed before start, handed back or dropped."""

    outcomes: Mapping[str, Outcome]


@dataclass(frozen=True, slots=True)
class CancelRequested:
    """A producer asked to cancel these jobs (ids of jobs this worker holds)."""

    job_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class WriteFailed:
    """A running job's replay log cannot be written: it fails."""

    job_id: str
    why: str


@dataclass(frozen=True, slots=True)
class Reaped:
    """Another worker declared this one dead and requeued all it held (under ``epoch``)."""

    epoch: int


@dataclass(frozen=True, slots=True)
class Suspended:
    """rq's suspend key came (True) or went (False)."""

    suspended: bool


@dataclass(frozen=True, slots=True)
class MasterChanged:
    """The Redis master changed (a failover) and its records were made to agree with the
    jobs held (:mod:`mlxq.worker.resync`): ``kept`` runs (id, execution id, attempt) go on
    under that attempt, restreaming their text; ``lost`` ones (id, execution id) are
    another worker's now, or ended: they are dropped."""

    kept: tuple[tuple[str, str, int], ...]
    lost: tuple[tuple[str, str], ...]


Message = (
    Started | Ended | Settled | CancelRequested | WriteFailed | Reaped | Suspended | MasterChanged
)
Inbox = queue.SimpleQueue[Message]


def unhandled(message: NoReturn) -> NoReturn:
    """The ``case _`` of a ``match`` on a :data:`Message`: mypy holds every type named
    above it (only then is ``message`` of no type left), and one missed fails here.
    ``typing.assert_never`` does this from Python 3.11; mlxq supports 3.10."""
    raise AssertionError(f"unhandled message: {message!r}")
