"""Jobs claimed, decoded and tokenized ahead of need, off the decode thread.

The decode loop says how many jobs it could use soon and how many wait at each level
(:meth:`Prefetcher.plan`); this thread keeps that many ready in a local buffer: it claims
them in bulk (one script call per queue moves and reads many, all in one round trip),
checks each payload by name, tokenizes it, and hands over :class:`Job` records. Serving
several levels, it claims for the highest first, and a level sees only the jobs of its
own and higher levels as ready: a buffer full of a sweep's jobs never keeps a chat job
in Redis, and a million-job sweep stays there. When the queues are empty it blocks on
the first, so an idle worker hears of a job at once (the others are looked at every
:data:`~mlxq.worker.bridge.POLL_S`). A job
that cannot run (unreadable, invalid, too long, past its ttl) fails here, by its reason,
through the writer; it never reaches the decode loop. A chat turn whose history another
worker holds in its prompt cache is handed to that worker here, before it is tokenized
(:class:`mlxq.worker.routing.Router`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from datetime import datetime

import redis

from mlxq.batching.levels import Levels
from mlxq.producer.codec import decode_job_data
from mlxq.producer.errors import PayloadError
from mlxq.producer.params import GenerationRequest
from mlxq.worker.bridge import BLOCK_S, POLL_S, Bridge
from mlxq.worker.errors import LeaseLost
from mlxq.worker.held import Held
from mlxq.worker.jobs import Job
from mlxq.worker.logs import job_event
from mlxq.worker.routing import UNWAKEABLE_BLOCK_S, Router
from mlxq.worker.scripts import Claimed
from mlxq.worker.sink import Sink
from mlxq.worker.threads import Helper
from mlxq.worker.writes import ReleaseMode

log = logging.getLogger("mlxq.worker")

#: Longest job id accepted; rq's are UUIDs, anything this long is no id of ours.
MAX_ID_CHARS = 200
#: Characters a token may stand for, at most, when a prompt's length is checked against
#: the model's context before it is tokenized (tokenizing a huge prompt costs seconds).
MAX_CHARS_PER_TOKEN = 32


def prompt_chars(req: GenerationRequest) -> int:
    if req.prompt is not None:
        return len(req.prompt)
    return sum(len(m["content"]) for m in req.messages or ())


def readable_id(raw: bytes) -> str | None:
    """A job id read from Redis, or None when it could be no id of ours."""
    try:
        job_id = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not 0 < len(job_id) <= MAX_ID_CHARS or not job_id.isprintable():
        return None
    return job_id


def decode_request(raw: bytes, max_tokens_cap: int) -> GenerationRequest:
    """Check what a claimed job's stored data holds; never trusts (or unpickles) it.

    Raises:
        PayloadError: naming what is wrong.
    """
    return GenerationRequest.from_payload(decode_job_data(raw), max_tokens_cap=max_tokens_cap)


def ttl_expired(req: GenerationRequest, enqueued_at: float | None) -> str | None:
    """Why a job waited past its ``ttl`` in the queue, or None."""
    if req.ttl is None or enqueued_at is None:
        return None
    waited = time.time() - enqueued_at
    if waited <= req.ttl:
        return None
    return f"ttl expired: waited {waited:.1f} s in the queue (ttl={req.ttl:g} s)"


def _timestamp(value: str) -> float | None:
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


class Prefetcher(Helper):
    """Keeps ``want`` jobs ready for the decode loop.

    Args:
        bridge: The worker's Redis.
        sink: The writer, for jobs that fail before they start.
        encode: Tokenizes a request (raises ``PayloadError`` for a prompt the model
            cannot take).
        max_tokens_cap: Largest ``max_tokens`` accepted.
        max_prompt_chars: Longest prompt (characters) worth tokenizing for this model.
        held: The jobs the worker holds; the ones ready here are marked in it.
        routing: Hand chat turns to the worker holding their history.
        levels: The queues served, by level (None: the bridge's one queue).
    """

    error_wait_s = 0.5

    def __init__(
        self,
        bridge: Bridge,
        sink: Sink,
        encode: Callable[[GenerationRequest], list[int]],
        *,
        max_tokens_cap: int,
        max_prompt_chars: int,
        held: Held,
        routing: bool,
        levels: Levels | None = None,
    ) -> None:
        super().__init__("mlxq-prefetch", "prefetch", join_s=10)
        self.bridge, self.sink, self.encode = bridge, sink, encode
        self.max_tokens_cap, self.held = max_tokens_cap, held
        self.max_prompt_chars = max_prompt_chars
        self.routing = routing
        self.router = Router(bridge)
        self.levels = levels or Levels.parse([bridge.queue_name])
        self.want = 0  # jobs the loop could use soon, beside those waiting for a row
        self._waiting: dict[str, int] = {}  # jobs the loop holds waiting, by queue
        self.failed = 0
        self.handed = 0  # jobs handed to another worker
        self.handed_in = 0  # jobs another worker handed this one
        self.claim_calls = 0  # claims made (a claim moves and reads many jobs at once)
        self.jobs_claimed = 0  # the jobs they brought
        self._ready: deque[Job] = deque()
        self._cond = threading.Condition()
        self._paused = threading.Event()
        self._resync = True  # look over the WIP list first: a restart may have left entries

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def pause(self, paused: bool) -> None:
        """Claim nothing while paused (a suspended queue, a lost lease)."""
        if paused:
            self._paused.set()
        else:
            self._paused.clear()
            with self._cond:
                self._cond.notify_all()

    def plan(self, want: int, waiting: Mapping[str, int]) -> None:
        """Have jobs ready for ``want`` rows, beside ``waiting`` (the jobs the loop holds
        waiting for a row, by queue): a level claims only for the rows its own and higher
        levels' jobs leave, and a queue of a shared level only for its weight's share."""
        with self._cond:
            self.want, self._waiting = want, dict(waiting)

    def take(self) -> list[Job]:
        """Everything ready, in claim order (called by the decode loop)."""
        with self._cond:
            jobs = list(self._ready)
            self._ready.clear()
            # Held by the loop now, waiting for a row or in one, until its next plan says
            # which: counted as waiting meanwhile, or this thread would claim their number
            # again (an idle window takes jobs several times before it plans).
            for j in jobs:
                self._waiting[j.queue] = self._waiting.get(j.queue, 0) + 1
            self.held.taken()
            self._cond.notify_all()
        return jobs

    def wait(self, timeout: float) -> bool:
        """Block until a job is ready or ``timeout`` passed; whether one is."""
        with self._cond:
            if not self._ready:
                self._cond.wait(timeout)
            return bool(self._ready)

    # -- the thread --------------------------------------------------------------------

    def _on_outage(self) -> None:
        self._resync = True  # a move whose reply was lost may have moved a job to us
        super()._on_outage()

    def _on_error(self, error: Exception) -> None:
        if isinstance(error, LeaseLost):
            self._stop.wait(0.2)  # the liveness thread sorts the lease out
            return
        # A claim that raised may have moved jobs into the WIP list first.
        self._resync = True
        super()._on_error(error)

    def _needs(self) -> dict[str, int]:
        """How many jobs to claim from each queue, highest level first (none: nothing to
        claim now, after a short wait)."""
        with self._cond:
            needs: dict[str, int] = {}
            if not self._paused.is_set():
                have = Counter(j.queue for j in self._ready)
                for q, n in self._waiting.items():
                    have[q] += n
                above = 0
                for level in self.levels.levels:
                    mine = sum(have[s.queue] for s in level)
                    above += mine
                    need = self.want - above
                    if need <= 0:
                        continue
                    if len(level) == 1:
                        needs[level[0].queue] = need
                        continue
                    # Queues sharing a level each keep their weight's share of the rows
                    # ready (at least one), so a backlog of one never shuts out another.
                    total = sum(s.weight for s in level)
                    room = self.want - (above - mine)
                    for s in level:
                        share = max(1, math.ceil(room * s.weight / total)) - have[s.queue]
                        if share > 0:
                            needs[s.queue] = min(share, need)
            if not needs:
                self._cond.wait(0.05)
            return needs

    def _turn(self) -> None:
        if self._resync:
            stray = [
                raw
                for raw in self.bridge.wip()
                if (i := readable_id(raw)) is None or not self.held.holds(i)
            ]
            self._resync = False
            if stray:
                self._accept(self._claim_each(stray))
        needs = self._needs()
        if not needs:
            return
        claimed = self.bridge.claim(needs)
        self.claim_calls += 1
        if not claimed:
            # Nothing in any queue: block on the highest that wants jobs (every queue but
            # one is looked at again every POLL_S).
            queue = next(iter(needs))
            self.router.note_blocker()
            wait = BLOCK_S if len(self.levels.queues) == 1 else POLL_S
            if not self.router.wakeable:  # a job handed here must be found within its grace
                wait = min(wait, UNWAKEABLE_BLOCK_S)
            first = self.bridge.wait_for_job(queue, wait)
            if first is None:
                return
            if self._stop.is_set():  # stopping: hand it straight back
                self.sink.release(ReleaseMode.REQUEUE, [first])
                return
            needs[queue] -= 1
            claimed = self.bridge.claim(needs, [first])
            self.claim_calls += 1
        self.jobs_claimed += len(claimed)
        self._accept(claimed)

    def _claim_each(self, stray: list[bytes]) -> list[Claimed]:
        """Claim entries found in the WIP list; should the claim raise (a record of a kind
        it cannot heal), one by one, and an entry whose own claim raises leaves the list
        with the reason, so it never blocks the others."""
        try:
            return self.bridge.claim(0, stray)
        except redis.ResponseError as e:
            log.warning("prefetch: a claim raised (%s); claiming its entries one by one", e)
        claimed = []
        for raw in stray:
            try:
                claimed += self.bridge.claim(0, [raw])
            except redis.ResponseError as e:
                log.error("dropped queue entry %r: its claim raised (%s)", raw[:80], e)
                self.sink.release(ReleaseMode.DROP, [raw])
        return claimed

    def _accept(self, claimed: list[Claimed]) -> None:
        checked = [x for c in claimed if (x := self._check(c)) is not None]
        self.handed_in += sum(c.handed for _, c, _ in checked)
        if self.routing:
            hand = self.router.hand_off(checked, self.held.load())
            checked, self.handed = hand.kept, self.handed + hand.handed
            self._resync = self._resync or hand.unsure
        ready = [job for x in checked if (job := self._encode(*x)) is not None]
        if ready:
            with self._cond:
                self._ready.extend(ready)
                self.held.ready(j.id for j in ready)
                self._cond.notify_all()

    def _check(self, c: Claimed) -> tuple[str, Claimed, GenerationRequest] | None:
        """A claimed job's id and checked request, or None when it cannot run (failed or
        dropped here, by its reason)."""
        job_id = readable_id(c.id)
        if job_id is None:
            log.warning("dropped queue entry %r: not a job id", c.id[:80])
            self.sink.release(ReleaseMode.DROP, [c.id])
            return None
        if c.verdict != "ok":
            self._refused(job_id, c)
            return None
        if self.held.runs(job_id):
            log.warning("job %s: a second queue entry for a job this worker holds; dropped", job_id)
            self.sink.release(ReleaseMode.DROP, [job_id])
            return None
        try:
            req = decode_request(c.data, self.max_tokens_cap)
            if (why := ttl_expired(req, _timestamp(c.enqueued_at))) is not None:
                self._fail(job_id, c, why)
                return None
            if (n := prompt_chars(req)) > self.max_prompt_chars:
                raise PayloadError(
                    f"prompt: {n} characters, more than this model's context "
                    f"can hold (at most {self.max_prompt_chars})"
                )
        except PayloadError as e:
            self._fail(job_id, c, f"invalid job: {e}")
            return None
        return job_id, c, req

    def _encode(self, job_id: str, c: Claimed, req: GenerationRequest) -> Job | None:
        try:
            ids = self.encode(req)
        except PayloadError as e:
            self._fail(job_id, c, f"invalid job: {e}")
            return None
        except Exception as e:  # a tokenizer or template error is this job's, not ours
            self._fail(job_id, c, f"invalid job: {type(e).__name__}: {e}")
            return None
        return Job(
            job_id,
            req,
            ids,
            c.attempts,
            c.clean,
            _timestamp(c.enqueued_at),
            epoch=self.bridge.epoch,
            # A job whose record names a queue this worker does not serve (a rogue
            # origin on a handed job) is scheduled as its first queue's.
            queue=c.queue if c.queue in self.levels.queues else self.bridge.queue_name,
        )

    def _refused(self, job_id: str, c: Claimed) -> None:
        reasons = {
            "nodata": "its record has no job data",
            "toolarge": f"its job data is too large ({c.detail} bytes)",
            "bad": f"its record holds {c.detail}",
            "broken": f"{c.detail} (replaced)",
        }
        if c.verdict in reasons:
            self._fail(job_id, c, f"unreadable job record: {reasons[c.verdict]}")
        elif c.verdict in ("dup", "missing") or (c.verdict == "mine" and self.held.holds(job_id)):
            log.warning("job %s: dropped a stale queue entry (%s %s)", job_id, c.verdict, c.detail)
        elif c.verdict == "mine":
            # Started here, not run here: its end was lost (a failover promoted a replica
            # that never saw it). Nobody else would ever run it: back to the queue.
            log.warning("job %s: started by this worker, which no longer runs it: requeued", job_id)
            self.sink.release(ReleaseMode.CLEAN, [job_id])
        elif c.verdict == "canceled":
            job_event(
                log,
                "canceled",
                job_id,
                c.queue or self.bridge.queue_name,
                c.attempts + 1,
                reason="canceled before it started",
            )

    def _fail(self, job_id: str, c: Claimed, reason: str) -> None:
        job_event(
            log,
            "failed",
            job_id,
            c.queue or self.bridge.queue_name,
            c.attempts + 1,
            logging.WARNING,
            reason=f"before start: {reason}",
        )
        self.failed += 1
        self.sink.fail(job_id, c.attempts, reason)
