"""What a worker says of itself, once a second: ``mlxq info``, the Prometheus metrics and
the hand-off script (its ``room`` and ``load``) read it.

:class:`WorkerStats` is taken by the decode loop's ``stats()`` from any thread; the
heartbeat stores it in the worker's stats hash (``mlxq:worker:<name>``) as a msgpack map,
:meth:`WorkerStats.as_record`, whose keys and their order are what readers of the hash
have always found.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from mlxq.producer.outcome import Outcome


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One worker's numbers at ``updated_at``; the fields' order is the record's.

    The engine's counters run from the worker's start; ``jobs_*`` count jobs settled by
    outcome (``jobs_failed`` with the jobs that failed before they started); ``running``
    (decoding), ``buffered`` (waiting for a row) and ``paused`` are jobs held now; ``room``
    the rows a handed chat turn may take (none
    while stopping or suspended), ``load`` the rows held; ``batch_sizes`` how many decode
    steps ran with each number of rows.
    """

    name: str
    queue: str
    model: str
    max_batch: int
    window_ms: float
    decode_steps: int
    vectorized_steps: int
    sampler_calls: int
    tokens_generated: int
    prompt_tokens: int
    prompt_tokens_prefilled: int
    prompt_cache_queries: int
    prompt_cache_hits: int
    prompt_tokens_cached: int
    prompt_cache_bytes: int
    jobs_finished: int
    jobs_failed: int
    jobs_canceled: int
    jobs_requeued: int
    tok_s_1m: float
    suspended: bool
    updated_at: float
    running: int
    buffered: int
    room: int
    load: int
    jobs_handed_out: int
    jobs_handed_in: int
    pid: int
    cancels_ignored: int
    started_at: float
    batch_sizes: dict[str, int]
    #: Jobs this worker's heartbeat took back from dead workers (it fills this in).
    jobs_requeued_from_dead_workers: int = 0
    #: The queues served, highest level first; ``levels`` the same grouped by level,
    #: each queue with its weight (``[[["chat", 1]], [["a", 3], ["b", 1]]]``).
    queues: list[str] = field(default_factory=list)
    levels: list[list[list[Any]]] = field(default_factory=list)
    #: Jobs paused now (out of the batch for a higher level's job), and since the start:
    #: rows paused, rows put back, and prompt plus generated tokens prefilled again for
    #: resumed rows whose KV had to be dropped.
    paused: int = 0
    preemptions: int = 0
    resumes: int = 0
    resume_tokens_recomputed: int = 0
    #: Tokens decoded for each queue's jobs since the start, and jobs held now by queue.
    tokens_by_queue: dict[str, int] = field(default_factory=dict)
    held_by_queue: dict[str, int] = field(default_factory=dict)
    #: How jobs went in: prefill passes by rows (``{"rows": passes}``, padded rows where
    #: prefills are bucketed) and the distinct (rows, padded length) shapes among them;
    #: the idle window's batches by jobs taken (``{"jobs": windows}``); claim calls the
    #: prefetcher made and the jobs they brought.
    prefill_batch_sizes: dict[str, int] = field(default_factory=dict)
    prefill_shapes: int = 0
    window_sizes: dict[str, int] = field(default_factory=dict)
    claim_calls: int = 0
    jobs_claimed: int = 0
    #: Decode steps on which a busy batch let waiting jobs gather instead of admitting
    #: them (``--admit-hold-steps``), and whether prefills are padded to bucketed shapes.
    admit_held_steps: int = 0
    prefill_buckets: bool = False
    #: What input the model takes: its context in tokens (0: it names none) and its
    #: vocabulary's size; a gateway refuses requests past them before they are queued.
    max_context: int = 0
    vocab_size: int = 0
    #: The fingerprint of the model served (``mlxq.worker.identity``; ``model`` is the
    #: path or repo id it was given): workers of one queue serve the same one.
    model_digest: str = ""
    #: Structured outputs: rows that decoded under a constraint, constraints compiled for
    #: the model (once each, then cached), and milliseconds spent filling their token masks.
    constrained_rows: int = 0
    constraint_compiles: int = 0
    mask_ms: float = 0.0
    #: The tool-call format the model's answers use (``mlxq.producer.tools.FORMATS``),
    #: which a gateway reads ``tool_choice="auto"`` answers in; "": none mlxq reads.
    tool_format: str = ""
    #: How long an idle window may stay open while a burst is still coming in.
    window_max_ms: float = 0.0
    #: The decode thread's milliseconds since the start by stage, each stage's own time
    #: (``mlxq.worker.stages``): ``decode`` (the batch's steps), ``prefill``,
    #: ``first_token``, ``rows_join``, ``rows_leave``, ``pause``, ``detokenize``,
    #: ``prompt_cache``, ``step_other``, ``schedule``, ``intake`` (an idle worker's wait
    #: with it), ``inbox`` and ``post``.
    busy_ms: dict[str, float] = field(default_factory=dict)
    #: Of ``decode_steps``, the passes new rows took for their first token alone (a
    #: lower level's rows and resumed rows take theirs in the batch's next step).
    first_token_passes: int = 0
    #: The decode steps a busy batch lets waiting jobs gather (``--admit-hold-steps``,
    #: ``auto`` as decided where MLX runs the model).
    admit_hold_steps: int = 0
    #: New rows whose first token came from the prefill that fed their last prompt token
    #: (no pass of their own).
    first_tokens_from_prefill: int = 0
    #: Whether decode steps run the batch's tokens as one sequence through the model
    #: (``mlxq.worker.fused_pass``; False: mlx-lm's call of a token a row, for a model
    #: whose layers are not the common decoder layout), and the new rows whose prompt ran
    #: in the batch's decode pass (``--fused-prefill``: whether it may; no prefill pass of
    #: their own).
    one_sequence: bool = False
    fused_prefill: bool = False
    fused_prefills: int = 0
    #: Rows that joined the decoding batch into the places of rows that had left, rows
    #: that joined by a copy of every row's KV, and the times the batch dropped the places
    #: rows had left (``mlxq.worker.kv_slots``).
    rows_joined_in_place: int = 0
    rows_joined_by_copy: int = 0
    slot_gathers: int = 0

    @property
    def state(self) -> str:
        """rq's word for the worker: ``busy``, ``suspended`` or ``idle``."""
        return "busy" if self.running or self.paused else "suspended" if self.suspended else "idle"

    def jobs(self, outcome: Outcome) -> int:
        """Jobs settled with one of the outcomes counted (finished, failed, canceled,
        requeued)."""
        counted = {
            Outcome.FINISHED: self.jobs_finished,
            Outcome.FAILED: self.jobs_failed,
            Outcome.CANCELED: self.jobs_canceled,
            Outcome.REQUEUED: self.jobs_requeued,
        }
        return counted[outcome]

    def as_record(self) -> dict[str, Any]:
        """The map stored in Redis, its keys in the fields' order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
