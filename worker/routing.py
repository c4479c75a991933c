"""Which worker a chat turn belongs to: the one whose prompt cache holds its history.

Each worker keeps its own prompt cache, and a chat resends its whole history every turn,
so a turn claimed by another worker than the one that made the last reply prefills that
history again. When a chat job finishes, its worker names itself under the conversation
so far (the messages plus the reply, as the client will send them back); a worker that
claims a job whose history (every message but the last) is so named hands it to that
worker, should it be live and have free rows (:class:`Router`, which the prefetcher calls
before it tokenizes what it claimed).

The key is a digest of the messages' roles, names and texts, so it takes no tokenizer
and holds no text. Raw-prompt jobs are not routed: a sweep's shared prefix is prefilled
once by each worker anyway, and routing it would pile a sweep on one worker.

The whole feature: the route keys (here), the hand-off (:class:`Router`: ``hand.lua``, and
a wake-up for a worker blocked on an empty queue), the finishing worker naming itself
(``route.lua``, with the job's end: :mod:`mlxq.worker.commit`), a handed job claimed first
(``claim.lua``) or given back when left unclaimed (``giveback.lua``, at each heartbeat:
:data:`mlxq.worker.bridge.HAND_GRACE_MS`; ``leave.lua``, at a clean stop).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from mlxq.producer import keys, scripts
from mlxq.producer.params import GenerationRequest
from mlxq.worker import scripts as lua
from mlxq.worker.bridge import HAND_GRACE_MS, Bridge
from mlxq.worker.config import is_worker_name
from mlxq.worker.logs import job_event
from mlxq.worker.scripts import Claimed, WorkerKeys

log = logging.getLogger("mlxq.worker")

#: A chat turn is handed to the worker holding its history only while that worker holds
#: at most this share more rows than the one that claimed it, plus :data:`HAND_SLACK`.
HAND_SHARE = 1.5
HAND_SLACK = 4
#: How long a worker's handed set outlives its last entry (a dead worker's goes).
HANDED_TTL_MS = 60_000
#: How long a worker is named as holding a finished conversation (its cache may have
#: dropped it sooner: then the next turn is a miss, as without routing).
ROUTE_TTL = 900
#: How long an idle worker that cannot be woken (its Redis user may not run CLIENT ID)
#: blocks waiting for the queue: well within the grace a job handed to it is kept.
UNWAKEABLE_BLOCK_S = HAND_GRACE_MS / 2000
#: How often a worker, idle and about to block, writes its blocking connection's id anew.
BLOCKER_TTL = 60


def conversation_key(queue: str, messages: Sequence[dict[str, str]]) -> str:
    """The route key of a conversation: a digest of its messages, in order."""
    h = hashlib.sha256()
    for m in messages:
        row = [m["role"], m.get("name", ""), m["content"]]
        h.update(json.dumps(row, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
    return keys.route_key(queue, h.hexdigest()[:32])


def continues(queue: str, req: GenerationRequest) -> str | None:
    """The route key of the conversation a chat job continues (its messages up to a
    reply), or None when it continues none."""
    m = req.messages
    if m is None or len(m) < 2 or m[-2]["role"] != "assistant":
        return None
    return conversation_key(queue, m[:-1])


def finished_as(queue: str, req: GenerationRequest, reply: str) -> str | None:
    """The route key a chat job's next turn will look up, once it replied ``reply``;
    None for a raw prompt or several choices (the client keeps one of them)."""
    if req.messages is None or req.n != 1:
        return None
    return conversation_key(queue, (*req.messages, {"role": "assistant", "content": reply}))


#: A claimed job the prefetcher checked: its id, its claim, its request.
Checked = tuple[str, Claimed, GenerationRequest]


@dataclass(frozen=True, slots=True)
class HandOff:
    """What :meth:`Router.hand_off` did with a claim's checked jobs."""

    kept: list[Checked]  # to run here
    handed: int  # how many went to another worker
    #: A hand's reply was lost: the job may have gone. The WIP list, looked over next,
    #: says whether it is this worker's.
    unsure: bool = False


def _worker_name(v: object) -> str | None:
    """A worker name read from Redis, or None when it could not be one."""
    name = v.decode("utf-8", "replace") if isinstance(v, bytes) else None
    return name if is_worker_name(name) else None


class Router:
    """One worker's side of the hand-off: it hands chat turns on, and can be woken.

    Args:
        bridge: The worker's Redis (its connection for moving jobs, its lease).
    """

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge
        self._blocker: tuple[int, float] | None = None  # (client id, write again after)
        self._blocker_refused = False

    def hand_off(self, checked: list[Checked], held: int) -> HandOff:
        """Hand each chat turn whose history another live worker with free rows holds to
        it (``held``: rows this worker holds besides these); the rest stay. A hand-off that
        cannot be made leaves the job here; one whose reply was lost leaves it to the next
        look over the WIP list."""
        wanted = [
            (i, k)
            for i, (_, c, req) in enumerate(checked)
            if not c.handed and (k := continues(c.queue, req)) is not None
        ]
        if not wanted:
            return HandOff(checked, 0)
        gone: set[int] = set()
        handed, unsure = 0, False
        try:
            owners = self.routes([k for _, k in wanted])
            # What this worker will hold once the jobs it keeps of this claim are in.
            load = held + len(checked)
            for (i, _), to in zip(wanted, owners, strict=True):
                if to is None or to == self.bridge.name:
                    continue
                job_id, c, _ = checked[i]
                most = int((load - len(gone) - 1) * HAND_SHARE) + HAND_SLACK
                try:
                    verdict = self.hand(job_id, to, most)
                except (redis.ConnectionError, redis.TimeoutError):
                    # Its reply lost, the job may have gone: it does not run here on a guess
                    # (should it come back, a second claim of it would drop its only WIP
                    # entry). The WIP list, looked over next turn, says whether it is ours.
                    gone.add(i)
                    unsure = True
                    raise
                if verdict != "ok":
                    continue
                gone.add(i)
                handed += 1
                job_event(log, "handed", job_id, c.queue, c.attempts + 1, logging.DEBUG, to=to)
                self.wake(to, job_id)
        except Exception as e:  # the jobs not yet handed run here, as without routing
            log.warning("prefetch: handing chat turns on failed (%s); running them here", e)
        kept = [x for i, x in enumerate(checked) if i not in gone]
        return HandOff(kept, handed, unsure)

    def routes(self, route_keys: Sequence[str]) -> list[str | None]:
        """The worker each route key names (None: none, or no readable name)."""
        # MGET reads a key of another type as no value: a rogue key never raises here.
        names = self.bridge.mover.mget(route_keys) if route_keys else []
        return [_worker_name(v) for v in names]

    def hand(self, job_id: str, to: str, most_load: int) -> str:
        """Hand a claimed, unstarted job to worker ``to`` should it hold at most
        ``most_load`` rows; ``ok`` or why not (it stays)."""
        b = self.bridge
        to_keys = WorkerKeys.of(b.queue_name, to)
        now_ms = int(time.time() * 1000)
        call = lua.hand(b.k, b.token, job_id, to_keys, now_ms, HANDED_TTL_MS, most_load)
        return scripts.call(b.mover, call)

    def wake(self, to: str, job_id: str, tries: int = 25) -> bool:
        """Wake worker ``to`` should it be blocked waiting for the queue; gives up once
        it has claimed ``job_id`` (it was not blocked, or woke) or after ``tries``."""
        mover = self.bridge.mover
        try:
            raw = mover.get(keys.blocker_key(to))
            cid = int(raw) if isinstance(raw, bytes) and raw.isdigit() else None
            for _ in range(tries):
                if cid is not None and mover.client_unblock(cid):
                    return True
                if mover.zscore(keys.handed_key(to), job_id) is None:
                    return True
                time.sleep(0.002)
        except redis.ResponseError:  # a rogue key of another type: its beat gives back
            pass
        return False

    @property
    def wakeable(self) -> bool:
        """Whether a worker handing this one a job can wake it from its idle wait (its
        Redis user may run CLIENT ID); if not, its idle waits must be shorter than the
        grace a handed job is kept for it."""
        return not self._blocker_refused

    def note_blocker(self) -> None:
        """Name the connection this worker blocks on, so a worker handing it a job can
        wake it; written again when the connection changed, or every half TTL. Called
        before each blocking wait for the queue."""
        if self._blocker_refused:
            return
        mover = self.bridge.mover
        try:
            cid = int(mover.client_id())
            now = time.monotonic()
            if self._blocker is None or self._blocker[0] != cid or now > self._blocker[1]:
                mover.set(self.bridge.k.blocker, cid, ex=BLOCKER_TTL)
                self._blocker = (cid, now + BLOCKER_TTL / 2)
        except redis.exceptions.NoPermissionError as e:  # an ACL without CLIENT: no wake-ups
            log.warning(
                "routing: cannot name this worker's idle connection (%s); it waits for "
                "jobs %.2f s at a time, so a job handed to it while idle is found in time",
                e,
                UNWAKEABLE_BLOCK_S,
            )
            self._blocker_refused = True
        except redis.ResponseError:  # out of memory, say: named at the next idle wait
            self._blocker = None
