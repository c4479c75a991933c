"""The engine's record of each batch row, and the plain output it hands back per step.

One :class:`Row` per choice of a running job (a job asking ``n`` samples holds ``n``
rows), kept by the :class:`~mlxq.worker.engine.Engine` from the insert that makes it to
the step or removal that ends it. It holds everything the engine needs about that row:
which job and choice it decodes for, its streaming detokenizer, its stop strings and stop
tokens, its constraint's matcher, and its counters. A paused row (taken out of the batch
with its KV and put back later) is one more :class:`RowStatus` and a field for that KV
here, not another table.

Each step turns every row's new token into one :class:`Delta`: text, token ids,
log-prob entries and, on its last token, the reason it ended. The job
(:meth:`mlxq.worker.jobs.Job.apply`) turns deltas into chunks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from mlxq.batching.stops import StopMatcher

if TYPE_CHECKING:
    from mlxq.batching.grammar import RowMatcher
    from mlxq.worker.jobs import Job

log = logging.getLogger("mlxq.worker")


class RowStatus(str, Enum):
    RUNNING = "running"  # in the batch, decoding
    PAUSED = "paused"  # out of the batch for now, its KV (if kept) on the row
    FINISHED = "finished"  # left the batch: ended, or removed with its job


@dataclass(slots=True, eq=False)
class Row:
    """One batch row: one choice of one job.

    Args:
        uid: mlx-lm's id of the row.
        job: The job it decodes for.
        index: Which of the job's choices it is.
        detok: Its streaming detokenizer (mlx-lm's, one per row).
        stops: Its stop strings, matched over the streamed text.
        stop_tokens: The token ids that end it (end-of-sequence, and the request's own).
        grammar: Its constraint's matcher (None: unconstrained), kept across a pause.
    """

    uid: int
    job: Job
    index: int
    detok: Any
    stops: StopMatcher
    stop_tokens: frozenset[int]
    grammar: RowMatcher | None = None
    status: RowStatus = RowStatus.RUNNING
    generated: int = 0  # tokens sampled, end-of-sequence included (usage counts it)
    #: While paused: its KV state, one cache per layer (None: dropped, or it was still in
    #: its prefill), and the tokens it goes on from (prompt and every token it emitted).
    kv: list[Any] | None = None
    kv_tokens: list[int] | None = None


# Not frozen, though never changed once made: one is made per row per decode step, and a
# frozen dataclass's constructor costs about four times a plain one's.
@dataclass(slots=True, eq=False)
class Delta:
    """What one step made for one choice of a job.

    ``text`` may be empty while a multi-byte character or a possible stop string is held
    back; ``token_ids`` is empty for a stop token (no part of the completion);
    ``generated`` is the row's count of tokens sampled so far; ``finish_reason`` is set
    on the row's last delta."""

    job: Job
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[str, Any]]
    finish_reason: str | None
    generated: int


def kv_nbytes(kv: list[Any] | None) -> int:
    """Bytes of a row's KV state (one cache per layer; None: none)."""
    return sum(int(c.nbytes) for c in kv) if kv else 0


def fit_paused_kv(rows: Iterable[Row], budget: int) -> None:
    """Drop paused rows' KV state, the first of ``rows`` first (the engine gives them in
    the order they joined the batch), until the rest fit ``budget`` bytes: those resume by
    prefilling what they had (counted)."""
    kept = [r for r in rows if r.status is RowStatus.PAUSED and r.kv]
    total = sum(kv_nbytes(r.kv) for r in kept)
    for row in kept:
        if total <= budget:
            return
        total -= kv_nbytes(row.kv)
        row.kv = None
        log.info("job %s: its paused row's KV dropped (over the budget)", row.job.id)
