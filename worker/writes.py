"""What the decode loop asks the writer to write: one frozen record per write.

The decode loop (and the prefetcher, for jobs that never start) hands these to the writer
(:class:`~mlxq.worker.sink.Sink`), which gathers what queued up into one :class:`Flush`
and commits it in one round trip (:func:`mlxq.worker.commit.commit`); the scripts' replies
come back as one :class:`FlushReply`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from mlxq.producer.codec import Chunk
from mlxq.producer.outcome import Outcome


class ReleaseMode(str, Enum):
    """How held jobs are let go of (the release script's modes)."""

    #: Back to the queue's front (a batch failed, a buffered job was canceled): a cancel
    #: pending on it ends it canceled instead.
    REQUEUE = "requeue"
    #: The same on a clean hand-back (shutdown, ``rq suspend``): no attempt is counted.
    CLEAN = "clean"
    #: Only out of the WIP list (an entry that is no job, or no readable id).
    DROP = "drop"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class StartWrite:
    """A claimed job joins the batch: rq's records say it started."""

    kind: ClassVar[str] = "start"
    job_id: str
    attempts_before: int
    execution_id: str


@dataclass(frozen=True, slots=True)
class ChunkWrite:
    """One chunk for a running job's replay log and channel."""

    kind: ClassVar[str] = "chunks"
    job_id: str
    chunk: Chunk
    refresh_ttl: bool  # set the log's TTL again with this chunk


@dataclass(frozen=True, slots=True)
class End:
    """A running job's end: its last chunk, its result or failure, rq's records."""

    kind: ClassVar[str] = "end"
    job_id: str
    outcome: Outcome  # finished | failed | canceled
    execution_id: str
    started_at: float
    final: Chunk
    canceled: Chunk  # written instead of final when a cancel won the race
    result: dict[str, Any] | None = None
    reason: str = ""
    route: str | None = None  # its conversation's route key, to name this worker in


@dataclass(frozen=True, slots=True)
class FailWrite:
    """A claimed job that fails before it starts, with its error chunk
    (:func:`mlxq.worker.jobs.unstarted_error`)."""

    kind: ClassVar[str] = "fail"
    job_id: str
    reason: str
    chunk: Chunk


@dataclass(frozen=True, slots=True)
class Release:
    """Held jobs let go of; ids may be raw bytes that are no text (``drop`` only)."""

    kind: ClassVar[str] = "release"
    mode: ReleaseMode
    job_ids: tuple[str | bytes, ...]


Write = StartWrite | ChunkWrite | End | FailWrite | Release


def ids_of(write: Write) -> tuple[str, ...]:
    """The ids of the jobs a write is of (one per job, but a release may hold many)."""
    if isinstance(write, Release):
        return tuple(str(j) for j in write.job_ids)
    return (write.job_id,)


@dataclass(slots=True)
class Flush:
    """One round trip of writes, in the order they must land: chunks, then ends and
    failures and hand-backs, then starts (a row's end lands before its next job's start,
    so rq never shows more started jobs than the batch holds)."""

    chunks: list[ChunkWrite] = field(default_factory=list)
    ends: list[End] = field(default_factory=list)
    fails: list[FailWrite] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)
    starts: list[StartWrite] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.chunks or self.ends or self.fails or self.releases or self.starts)


@dataclass(slots=True)
class FlushReply:
    """What the scripts of one flush said (each script's reply is a part of it)."""

    started: dict[str, str] = field(default_factory=dict)  # id -> ok | canceled | refused
    ended: dict[str, Outcome] = field(default_factory=dict)  # id -> outcome | refused
    settled: dict[str, Outcome] = field(default_factory=dict)  # failed before start, released
    write_problems: list[tuple[str, str]] = field(default_factory=list)
    #: Keys of a job a script found of the wrong type and replaced: (id, what).
    healed: list[tuple[str, str]] = field(default_factory=list)

    def add(self, part: FlushReply) -> None:
        self.started.update(part.started)
        self.ended.update(part.ended)
        self.settled.update(part.settled)
        self.write_problems += part.write_problems
        self.healed += part.healed
