"""Which held jobs take the batch's free rows, and which running rows pause for them.

Each decode turn the loop asks :meth:`Scheduler.choose`. A free row goes to the highest
level with a job waiting; within a level, to the queue least served for its weight
(:class:`mlxq.batching.levels.Shares`: deficit round robin in tokens, a row's budget
``max_tokens`` charged when it is taken and trued up to what it made when it leaves);
within a queue, paused jobs first, then admission's order (FIFO, grouped by sampling
params: :func:`mlxq.batching.admission.admit`). A waiting job of a strictly higher level
that finds no free row pauses the youngest row of the lowest level running
(:func:`mlxq.batching.levels.to_pause`), unless enough rows end for sure within
:data:`PAUSE_WAIT_STEPS`. A busy batch of one level lets its freed rows gather for one
prefill (:class:`mlxq.batching.prefill.Gather`), longer for the lowest of several levels
(:data:`LOWEST_HOLD_FACTOR`); a paused job, or a job of a higher level than the lowest
running, never waits for that.
"""

from __future__ import annotations

import logging
from collections import Counter

from mlxq.batching.admission import AdmissionPolicy, admit
from mlxq.batching.levels import Running, Shares, to_pause
from mlxq.batching.prefill import Gather
from mlxq.worker.config import CUDA_ADMIT_HOLD_STEPS, DEFAULT_ADMIT_HOLD_STEPS, WorkerConfig
from mlxq.worker.endings import Endings
from mlxq.worker.engine import Engine
from mlxq.worker.held import Held
from mlxq.worker.jobs import Job, Status

log = logging.getLogger("mlxq.worker")

#: Where every waiting job is of the lowest of several levels (a sweep beside interactive
#: traffic), its freed rows may gather up to this many times ``--admit-hold-steps`` (16
#: steps by default) for one prefill. Each interactive job leaves sweep rows out of step
#: with the rest (the row it took, the row paused for it), and on a GPU each refill of a
#: few rows costs a prefill pass of its own (and for the first level's rows a first-token
#: pass: lower levels' ride in the next decode step, ``Engine.add``), a decode step or two
#: of the whole batch: gathered a few steps at most, a sweep's rows split into more and more
#: cohorts, each refilled apart. The gather rule's own bound (rows stand idle no longer
#: than the refill they save would cost) keeps many rows from waiting long, and no job of
#: a higher level ever waits for this. Longer (64 steps) refilled the sweep in fewer passes
#: on a CPU but in bigger ones, each a long wait there for a chat job that lands in it (the
#: soak's interactive p99: 0.7 s -> 2.0-2.5 s); ``--admit-hold-steps 16`` gives that.
LOWEST_HOLD_FACTOR = 4
#: A waiting job of a higher level pauses no row while as many rows end for sure within
#: this many decode steps (their ``max_tokens`` run out): a sweep of short jobs frees a row
#: about every step, and a pause and its resume cost far more than a step or two of wait.
PAUSE_WAIT_STEPS = 4


class Scheduler:
    """The decode thread's choice of jobs for free rows, and of rows to pause.

    Args:
        config: The worker's levels, batch size and pause settings.
        engine: The model's batch (free rows, rows about to end; rows are paused here).
        held: The jobs this worker holds.
        ends: Where the jobs admitted since the last step are kept (none is paused).
    """

    def __init__(self, config: WorkerConfig, engine: Engine, held: Held, ends: Endings) -> None:
        self.config, self.engine, self.held, self.ends = config, engine, held, ends
        self.policy = AdmissionPolicy(config.max_batch, config.max_wait_steps)
        #: ``admit_hold_steps``, ``auto`` decided by where MLX runs the model.
        self.hold_steps = hold_steps(config, engine)
        self.gather = Gather(self.hold_steps)
        self.shares = Shares(config.levels)
        self._level = {q: config.levels.level_of(q) for q in config.levels.queues}
        self._levels = len(config.levels.levels)

    def level(self, job: Job) -> int:
        """A job's level, 0 the highest."""
        return self._level.get(job.queue, 0)

    def choose(self, step: int, closed: bool) -> tuple[list[Job], list[Job]]:
        """The paused jobs to resume and the waiting jobs to start at decode step
        ``step`` (``closed``, stopping or suspended: paused jobs only); rows of lower
        levels may be paused first to make room."""
        paused = self._paused()
        buffered = [] if closed else self.held.jobs(Status.BUFFERED)
        if not paused and not buffered:
            return [], []
        if self.config.preempt and self._levels > 1 and self._preempt(paused + buffered):
            paused = self._paused()
        free = min(self.engine.free_slots, self.config.max_batch)
        if free <= 0:
            return [], []
        if not self._urgent(paused, buffered) and not self.gather.ready(
            step, free, len(buffered), self.engine.steps_left, self._hold(buffered)
        ):
            return [], []  # a busy batch, letting jobs gather for one prefill
        running = Counter(j.key for j in self.held.jobs(Status.RUNNING))
        # Each queue's jobs in the order they take its rows: paused ones first (they
        # started first), then admission's order (FIFO, grouped by sampling params).
        order: dict[str, list[Job]] = {}
        for job in paused:
            order.setdefault(job.queue, []).append(job)
        waiting: dict[str, list[Job]] = {}
        for job in buffered:
            waiting.setdefault(job.queue, []).append(job)
        for q, jobs in waiting.items():
            slots = min(len(jobs), free)
            order.setdefault(q, []).extend(admit(jobs, running, slots, step, self.policy))
        resume: list[Job] = []
        chosen: list[Job] = []
        kept = self._kept()
        while free > 0:
            top = [q for q, jobs in order.items() if jobs and self._may_take(q, free, kept)]
            pick = self.shares.pick(top)
            if pick is None:
                break
            job = order[pick].pop(0)
            free -= 1
            if self._level.get(pick, 0) == 0:  # a reserved row taken: one fewer kept
                kept = max(0, kept - 1)
            self._charge(job, job.request.max_tokens * job.request.n)
            (resume if job.status is Status.PAUSED else chosen).append(job)
        return resume, chosen

    def _hold(self, buffered: list[Job]) -> int | None:
        """The gather's hold for these waiting jobs: longer when all are of the lowest
        of several levels (:data:`LOWEST_HOLD_FACTOR`), else the rule's own (None)."""
        lowest = self._levels - 1
        if lowest > 0 and buffered and all(self.level(j) == lowest for j in buffered):
            return LOWEST_HOLD_FACTOR * self.hold_steps
        return None

    def left(self, job: Job) -> None:
        """A job left this worker: its queue is charged what it made, not its budget."""
        if job.charged:
            self._charge(job, job.generated)

    def _paused(self) -> list[Job]:
        """The paused jobs, the first started first."""
        return sorted(self.held.jobs(Status.PAUSED), key=lambda j: j.started_mono)

    def _urgent(self, paused: list[Job], buffered: list[Job]) -> bool:
        """Whether free rows take jobs now, gathering none (:class:`Gather`): a paused job
        waits to go on, or a job waits of a higher level than the lowest running."""
        if paused:
            return True
        running = self.held.jobs(Status.RUNNING)
        if not running or self._levels == 1:
            return False
        lowest = max(self.level(j) for j in running)
        return any(self.level(j) < lowest for j in buffered)

    def _first_level_rows(self) -> int:
        """Rows the first level's jobs hold."""
        return sum(self.level(j) == 0 for j in self.held.jobs(Status.RUNNING))

    def _kept(self) -> int:
        """Free rows lower levels leave to the first level: ``--reserve-rows`` counts the
        rows it holds, so a reserve in use costs lower levels no more rows than it has
        (else each interactive job running would take one more of a sweep's rows out of
        step). With no rows reserved, none, and the running jobs are not counted."""
        if not self.config.reserve_rows:
            return 0
        return max(0, self.config.reserve_rows - self._first_level_rows())

    def _may_take(self, queue: str, free: int, kept: int) -> bool:
        """Whether a job of ``queue`` may take one of ``free`` rows, ``kept`` of which
        lower levels leave to the first level."""
        return self._level.get(queue, 0) == 0 or free > kept

    def _charge(self, job: Job, upto: int) -> None:
        """Charge a job's queue share so that, in all, it was charged ``upto`` tokens:
        its budget (``max_tokens`` per choice) while it holds a row, what it made once
        it left one."""
        if job.queue in self._level:
            self.shares.charge(job.queue, upto - job.charged)
        job.charged = upto

    def _preempt(self, waiting: list[Job]) -> bool:
        """Pause rows of the lowest level running for jobs of strictly higher levels that
        find no free row; whether any was paused."""
        by_level = Counter(self.level(j) for j in waiting)
        lowest_waiting = min(by_level)
        running = self.held.jobs(Status.RUNNING)
        if not running or max(self.level(j) for j in running) <= lowest_waiting:
            return False
        riding = self.engine.riding()
        candidates = [
            Running(j.id, self.level(j), j.started_mono, j.pauses)
            for j in running
            # Not before its first token: pausing a row in its prefill throws that away;
            # nor a row that rides before the step that feeds it its last token.
            if j.id not in self.ends.fresh and j.generated > 0 and j.id not in riding
        ]
        ending = sum(n <= PAUSE_WAIT_STEPS for n in self.engine.steps_left())
        free = self.engine.free_slots + ending
        if lowest_waiting > 0:
            free -= self._kept()
        ids = set(to_pause(by_level, candidates, max(0, free), self.config.max_pauses))
        jobs = [j for j in running if j.id in ids]
        if not jobs:
            return False
        self.engine.pause(jobs)
        for job in jobs:
            job.status = Status.PAUSED
            job.pauses += 1
            self._charge(job, job.generated)
            log.info(
                "job %s (queue %s) paused after %d token(s): a job of a higher level waits",
                job.id,
                job.queue,
                job.generated,
            )
        return True


def hold_steps(config: WorkerConfig, engine: Engine | None) -> int:
    """The config's ``admit_hold_steps``; for None (``auto``), more where MLX runs on CUDA,
    where a refill pass costs a few decode steps whatever its rows."""
    if config.admit_hold_steps is not None:
        return config.admit_hold_steps
    on_cuda = engine is not None and engine.on_cuda
    return CUDA_ADMIT_HOLD_STEPS if on_cuda else DEFAULT_ADMIT_HOLD_STEPS
