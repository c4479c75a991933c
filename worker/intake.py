"""Where the decode loop's jobs come in: the prefetcher's ready jobs, taken into the held set.

Busy, the loop takes what is ready each turn without waiting. Idle, it waits for a first
job and then holds a window open (``window_ms``, longer while a burst is still coming in,
up to ``window_max_ms``) so a burst shares one prefill. It tells
the prefetcher how many jobs to have ready, and gives back the jobs not running yet when
it stops or rq's suspend key is set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from mlxq.batching.window import Window
from mlxq.worker.bridge import Bridge
from mlxq.worker.config import WorkerConfig
from mlxq.worker.endings import Endings
from mlxq.worker.engine import Engine
from mlxq.worker.held import Held
from mlxq.worker.jobs import Job, Status
from mlxq.worker.logs import log_queued
from mlxq.worker.prefetch import Prefetcher
from mlxq.worker.sink import Sink
from mlxq.worker.writes import ReleaseMode

log = logging.getLogger("mlxq.worker")


class Intake:
    """The decode thread's side of the prefetcher.

    Args:
        config: What to serve and how.
        engine: The model's batch (how many rows are free).
        bridge: The worker's Redis (the lease a job was claimed under).
        held: The jobs this worker holds: taken jobs are added.
        sink: The writer (a duplicate claim is dropped through it).
        prefetch: Where claimed jobs come from.
        ends: How jobs are handed back.
        stop: Set when the worker stops: the window closes at once.
    """

    def __init__(
        self,
        config: WorkerConfig,
        engine: Engine,
        bridge: Bridge,
        held: Held,
        sink: Sink,
        prefetch: Prefetcher,
        ends: Endings,
        stop: threading.Event,
    ) -> None:
        self.config, self.engine, self.bridge, self.held = config, engine, bridge, held
        self.sink, self.prefetch, self.ends, self._stop = sink, prefetch, ends, stop
        self.window = Window(
            config.window_ms / 1000, config.max_batch, longest_s=config.window_max_ms / 1000
        )
        self.window_sizes: dict[int, int] = {}  # jobs an idle window took: windows

    def want(self, closed: bool) -> None:
        """Tell the prefetcher how many jobs to have ready (none when ``closed``), and
        how many wait here for a row, by queue."""
        waiting = Counter(j.queue for j in self.held.jobs(Status.BUFFERED, Status.PAUSED))
        # A whole batch in reserve: when every row ends at once (a sweep of equal jobs),
        # the next batch is ready to prefill in one pass.
        want = self.engine.free_slots + self.config.max_batch
        self.prefetch.plan(0 if closed else want, waiting)

    def take(self, steps: int, suspended: bool) -> None:
        """Take the ready jobs (at step ``steps``); idle, wait a little for some."""
        if suspended:  # what the prefetcher still had in flight goes back
            self.hand_back("rq suspend", steps)
            if not self.engine.active:
                self.prefetch.wait(0.05)
            return
        if self.engine.active or self.held.jobs(Status.BUFFERED, Status.PAUSED):
            self.add(self.prefetch.take(), steps)
            return
        self.want(self._stop.is_set())
        if not self.prefetch.wait(0.05):
            return
        # Idle, and a first job came: hold a window open so a burst shares one prefill.
        self.window.open(time.monotonic())
        while True:
            came = self.add(self.prefetch.take(), steps)
            now = time.monotonic()
            if came:
                self.window.arrived(now)
            if (
                self.window.should_close(now, len(self.held.jobs(Status.BUFFERED)))
                or self._stop.is_set()
            ):
                break
            self.prefetch.wait(self.window.remaining(now))
        self.window.close()
        took = len(self.held.jobs(Status.BUFFERED))
        self.window_sizes[took] = self.window_sizes.get(took, 0) + 1

    def add(self, jobs: list[Job], steps: int) -> int:
        """Hold these jobs, arrived at step ``steps``: waiting for a row. Returns how
        many came."""
        for job in jobs:
            if job.epoch != self.bridge.epoch:
                continue  # claimed under a lease this worker lost: not its own
            if self.held.runs(job.id):
                log.warning(
                    "job %s: a second queue entry for a job this worker holds; dropped", job.id
                )
                self.sink.release(ReleaseMode.DROP, [job.id])
                continue
            job.arrived_step = steps
            self.held.add(job)
            log_queued(job.queue, job)
        return len(jobs)

    def hand_back(self, why: str, steps: int) -> None:
        """Give every job not running yet back to the queue's front, the prefetched ones
        too (a clean hand-back: no attempt is counted against them)."""
        self.add(self.prefetch.take(), steps)
        self.ends.release(self.held.jobs(Status.BUFFERED), ReleaseMode.CLEAN, why)
