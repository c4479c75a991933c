"""How a job ends, and how a worker lets go of one: the one list every layer reads.

:class:`Outcome` names what happened to a job a worker held: it ended (``finished``,
``failed``, ``canceled``: :data:`TERMINAL`) or the worker let go of it without ending it
(``requeued``: back in the queue; ``dropped``: no longer this worker's; ``refused``: Redis
would not take its write). The client's job statuses use the same words for the terminal
ones. The Lua scripts keep their own copy of :data:`RQ_TERMINAL` (``lua/lib.lua``); a test
holds the two equal.
"""

from __future__ import annotations

from enum import Enum


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
