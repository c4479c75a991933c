"""The worker's view of held jobs and its stats record, without Redis or a model."""

from __future__ import annotations

import dataclasses

from mlxq.producer.params import GenerationRequest
from mlxq.worker.held import Held
from mlxq.worker.jobs import Job, Status
from mlxq.worker.stats import WorkerStats


def _job(job_id: str, status: Status) -> Job:
    job = Job(job_id, GenerationRequest(prompt="x"), [1, 2])
    job.status, job.execution_id = status, f"exec-{job_id}"
    return job


def test_held_answers_for_the_loop_and_the_prefetcher_ready_buffer():
    held = Held()
    for job_id, status in (("r", Status.RUNNING), ("b", Status.BUFFERED), ("e", Status.ENDING)):
        held.add(_job(job_id, status))
    held.ready(["p"])
    assert [held.holds(i) for i in "rbep"] == [True, True, True, True]
    assert [held.runs(i) for i in "rbep"] == [True, True, False, True]  # a hand-back committing
    assert not held.holds("x") and not held.runs("x")
    assert held.rows() == (1, 1) and held.load() == 2
    assert held.ids() == ["r", "b"] and held.running() == [("r", "exec-r")]
    assert [j.id for j in held.jobs(Status.BUFFERED)] == ["b"]
    held.taken()
    assert not held.holds("p")
    held.settle("e")
    assert not held.holds("e") and len(held) == 2
    held.clear()
    assert len(held) == 0 and not held.holds("r")


def test_the_stats_record_keeps_its_keys_in_their_order():
    names = [f.name for f in dataclasses.fields(WorkerStats)]
    stats = WorkerStats(**{n: 0 for n in names if n != "batch_sizes"}, batch_sizes={"2": 3})
    assert list(stats.as_record()) == [
        "name", "queue", "model", "max_batch", "window_ms", "decode_steps",
        "vectorized_steps", "sampler_calls", "tokens_generated", "prompt_tokens",
        "prompt_tokens_prefilled", "prompt_cache_queries", "prompt_cache_hits",
        "prompt_tokens_cached", "prompt_cache_bytes", "jobs_finished", "jobs_failed",
        "jobs_canceled", "jobs_requeued", "tok_s_1m", "suspended", "updated_at", "running",
        "buffered", "room", "load", "jobs_handed_out", "jobs_handed_in", "pid",
        "cancels_ignored", "started_at", "batch_sizes", "jobs_requeued_from_dead_workers",
        "queues", "levels", "paused", "preemptions", "resumes", "resume_tokens_recomputed",
        "tokens_by_queue",
        "held_by_queue", "prefill_batch_sizes", "prefill_shapes", "window_sizes", "claim_calls",
        "jobs_claimed", "admit_held_steps", "prefill_buckets", "max_context", "vocab_size",
        "model_digest", "constrained_rows", "constraint_compiles", "mask_ms", "tool_format",
        "window_max_ms", "busy_ms", "first_token_passes", "admit_hold_steps",
        "first_tokens_from_prefill", "one_sequence",
        "fused_prefill", "fused_prefills", "rows_joined_in_place", "rows_joined_by_copy",
        "slot_gathers",
    ]  # fmt: skip
    assert stats.as_record()["batch_sizes"] == {"2": 3}
    assert stats.state == "idle"
    assert dataclasses.replace(stats, suspended=True).state == "suspended"
    assert dataclasses.replace(stats, running=1, suspended=True).state == "busy"
