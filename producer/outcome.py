"""How a job ends, and how a worker lets go of one: the one list every layer reads.

:class:`Outcome` names what happened to a job a worker held: it ended (``finished``,
``failed``, ``canceled``: :data:`TERMINAL`) or the worker let go of it without ending it
(``requeued``: back in the queue; ``dropped``: no longer this worker's; ``refused``: Redis
would not take its write). The client's job statuses use the same words for the terminal
ones: :data:`STATUS_OF_RQ` reads rq's statuses in them. The Lua scripts keep their own copy
of :data:`RQ_TERMINAL` (``lua/lib.lua``); a test holds the two equal.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any


class Outcome(str, Enum):
    FINISHED = "finished"
    FAILED = "failed"
    CANCELED = "canceled"
    REQUEUED = "requeued"
    DROPPED = "dropped"
    REFUSED = "refused"

    def __str__(self) -> str:
        return self.value


#: The outcomes that end a job: its status stays so for good.
TERMINAL: frozenset[Outcome] = frozenset({Outcome.FINISHED, Outcome.FAILED, Outcome.CANCELED})
#: rq's statuses that end a job: mlxq's terminal ones and rq's own ``stopped`` (which mlxq
#: reports as canceled).
RQ_TERMINAL: frozenset[str] = frozenset({*(o.value for o in TERMINAL), "stopped"})


def outcome_of(text: str) -> Outcome:
    """An outcome read back from a script's reply; anything else is ``dropped``."""
    try:
        return Outcome(text)
    except ValueError:
        return Outcome.DROPPED


#: rq's job statuses in the words of :meth:`Job.status` and ``mlxq jobs``: rq's waiting
#: kinds read ``queued``, and its ``stopped`` reads ``canceled``.
STATUS_OF_RQ: Mapping[str, str] = MappingProxyType(
    {
        "queued": "queued",
        "deferred": "queued",
        "scheduled": "queued",
        "created": "queued",
        "started": "started",
        **{o.value: o.value for o in TERMINAL},
        "stopped": Outcome.CANCELED.value,
    }
)


def job_status(raw: Any) -> str | None:
    """A job hash's raw ``status`` field in mlxq's words (a status rq adds later reads
    ``queued``); None when the field is absent: no such job."""
    if raw is None:
        return None
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return STATUS_OF_RQ.get(text, "queued")


class Failure:
    """What a failed job's reason means to an HTTP client: the status, OpenAI's error
    ``type`` and ``code`` that the gateway answers and run-batch writes.

    Input the model cannot take is the request's fault (400: a retry gets the same
    answer, so clients must not retry it), a deadline is a timeout (504), anything else
    is the server's (500). Read from the reason's prefix, which the worker writes
    (``invalid job: ...``, ``timeout: ...``, ``ttl expired: ...``).
    """

    __slots__ = ("code", "status", "type")

    def __init__(self, reason: str) -> None:
        if reason.startswith("invalid job: "):
            self.status, self.type = 400, "invalid_request_error"
            context = "the model's context" in reason or "this model's context" in reason
            self.code = "context_length_exceeded" if context else "invalid_request_error"
        elif reason.startswith(("timeout", "ttl expired")):
            self.status, self.type, self.code = 504, "timeout_error", "timeout"
        elif reason == "canceled":
            self.status, self.type, self.code = 500, "server_error", "job_canceled"
        else:
            self.status, self.type, self.code = 500, "server_error", "job_failed"
