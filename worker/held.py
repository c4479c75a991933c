"""The jobs a worker holds, as every thread may ask about them.

The decode loop alone adds jobs, settles them and changes their status; the prefetcher
alone marks the jobs it has ready (claimed and tokenized, not yet taken by the loop: held
all the same). The other threads only ask: the prefetcher whether a claim is a duplicate
and how loaded the worker is, the cancel listener whether an id is this worker's, the
heartbeat which jobs to check for cancels and whose rq records to keep fresh, the stats
how many rows are busy. A lock makes each answer one moment's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from mlxq.worker.jobs import Job, Status


class Held:
    """Every job a worker holds until its end (or hand-back) is committed."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}  # every job past the prefetcher, until settled
        self._ready: set[str] = set()  # ids the prefetcher has ready for the loop
        self._lock = threading.Lock()

    # -- the decode loop ---------------------------------------------------------------

    def add(self, job: Job) -> None:
        """A job taken from the prefetcher."""
        with self._lock:
            self._jobs[job.id] = job

    def get(self, job_id: str) -> Job | None:
        """The job of this id past the prefetcher, if held."""
        with self._lock:
            return self._jobs.get(job_id)

    def settle(self, job_id: str) -> None:
        """A job's end or hand-back was committed: it is no longer held."""
        with self._lock:
            del self._jobs[job_id]

    def clear(self) -> None:
        """Drop every job past the prefetcher (another worker requeued them all)."""
        with self._lock:
            self._jobs.clear()

    def jobs(self, *status: Status) -> list[Job]:
        """The jobs past the prefetcher (of these statuses; none: all), in the order they
        came."""
        with self._lock:
            jobs = list(self._jobs.values())
        return jobs if not status else [j for j in jobs if j.status in status]

    def started(self) -> list[Job]:
        """The jobs whose run started and has not ended: running, or paused."""
        return self.jobs(Status.RUNNING, Status.PAUSED)

    def __len__(self) -> int:
        return len(self._jobs)

    # -- the prefetcher ----------------------------------------------------------------

    def ready(self, job_ids: Iterable[str]) -> None:
        """Jobs the prefetcher made ready."""
        with self._lock:
            self._ready.update(job_ids)

    def taken(self) -> None:
        """The loop took every ready job."""
        with self._lock:
            self._ready.clear()

    # -- any thread --------------------------------------------------------------------

    def holds(self, job_id: str) -> bool:
        """Whether the worker holds a job in any state, its end not yet committed."""
        with self._lock:
            return job_id in self._jobs or job_id in self._ready

    def runs(self, job_id: str) -> bool:
        """Whether a job is ready, buffered or running here (a second claim of it is a
        rogue duplicate; a job whose hand-back is committing may be claimed again)."""
        with self._lock:
            job = self._jobs.get(job_id)
            return (job is not None and job.status is not Status.ENDING) or job_id in self._ready

    def rows(self) -> tuple[int, int]:
        """Jobs started (running, or paused for a higher level's job: both need a row)
        and jobs buffered (past the prefetcher, waiting for a row)."""
        statuses = [j.status for j in self.jobs()]
        started = statuses.count(Status.RUNNING) + statuses.count(Status.PAUSED)
        return started, statuses.count(Status.BUFFERED)

    def by_queue(self) -> dict[str, int]:
        """Jobs held (not ending) by queue."""
        counts: dict[str, int] = {}
        for j in self.jobs(Status.BUFFERED, Status.RUNNING, Status.PAUSED):
            counts[j.queue] = counts.get(j.queue, 0) + 1
        return counts

    def load(self) -> int:
        """Rows the worker holds, running or buffered."""
        return sum(self.rows())

    def ids(self) -> list[str]:
        """Ids of the jobs past the prefetcher that are not ending (a cancel may reach
        them)."""
        return [j.id for j in self.jobs() if j.status is not Status.ENDING]

    def running(self) -> list[tuple[str, str]]:
        """(id, execution id) of the started jobs (running or paused)."""
        return [(j.id, j.execution_id) for j in self.started()]

    def attempts(self) -> list[tuple[str, str, int, bool]]:
        """(id, execution id, attempt, whether it runs) of the started jobs: running,
        paused, or ending (its end being committed)."""
        jobs = self.jobs(Status.RUNNING, Status.PAUSED, Status.ENDING)
        return [(j.id, j.execution_id, j.attempt, j.status is not Status.ENDING) for j in jobs]
