"""The worker's log: text for people or JSON lines for log shippers, and one line per job
lifecycle event.

Every event of a job (``queued_wait``: claimed after waiting in the queue; ``started``,
``finished``, ``failed``, ``canceled``, ``requeued``, ``timed_out``) is logged by
:func:`job_event` as one line naming the job id, queue and attempt, with its tokens and
timings as fields: ``key=value`` in the text, top-level keys in JSON (passed as the
record's ``extra``). The decode loop's events come with their fields from
:func:`log_queued`, :func:`log_started` and :func:`log_end`. No log line carries a prompt
or generated text.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any

from mlxq.producer.outcome import Outcome
from mlxq.worker.jobs import Job

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Outcomes logged at INFO; the others (a failure, a job let go of) at WARNING.
QUIET = frozenset({Outcome.FINISHED, Outcome.CANCELED, Outcome.REQUEUED})
EVENTS = ("queued_wait", "started", "finished", "failed", "canceled", "requeued", "timed_out")

log = logging.getLogger("mlxq.worker")

#: How often one recurring warning (:data:`THROTTLE`) is logged at most.
THROTTLE_S = 60.0


class Throttle:
    """Warnings that may recur as fast as a loop turns (a rogue key rewritten as soon as it
    is replaced, a queue of the wrong type polled) go out at most once per ``every``
    seconds for each ``key``, the next one saying how many were held back meanwhile.

    Args:
        every: Seconds between two warnings of one key.
        most: Keys remembered at most (the oldest are forgotten first).
    """

    def __init__(self, every: float = THROTTLE_S, most: int = 1024) -> None:
        self.every, self.most = every, most
        self._last: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` unless ``key`` was logged within ``every`` s; whether it was."""
        now = time.monotonic()
        with self._lock:
            last, held = self._last.pop(key, (-self.every, 0))
            if now - last < self.every:
                self._last[key] = (last, held + 1)
                return False
            self._last[key] = (now, 0)
            while len(self._last) > self.most:
                del self._last[next(iter(self._last))]
        if held:
            msg, args = msg + " (%d more like it since)", (*args, held)
        log.warning(msg, *args)
        return True


#: The worker's one throttle of recurring warnings.
THROTTLE = Throttle()

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``message``,
    every ``extra`` field, and ``exc`` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


def setup(level: str, fmt: str = "text") -> None:
    """Configure the root logger for the worker process.

    Raises:
        ValueError: an unknown level or format.
    """
    if fmt not in FORMATS:
        raise ValueError(f"log_format={fmt!r}: must be one of {', '.join(FORMATS)}")
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise ValueError(f"log_level={level!r}: must be DEBUG, INFO, WARNING or ERROR")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # rq's worker methods log job descriptions at INFO; mlxq logs its own job events.
    logging.getLogger("rq").setLevel(logging.WARNING)


def _text(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    s = str(v)
    return repr(s) if any(c.isspace() for c in s) or not s else s


def job_event(
    log: logging.Logger,
    event: str,
    job_id: str,
    queue: str,
    attempt: int,
    level: int = logging.INFO,
    **fields: Any,
) -> None:
    """Log one lifecycle event of a job; fields that are None are left out."""
    extra = {"event": event, "job_id": job_id, "queue": queue, "attempt": attempt}
    extra.update({k: v for k, v in fields.items() if v is not None})
    detail = " ".join(f"{k}={_text(v)}" for k, v in extra.items() if k not in ("event", "job_id"))
    log.log(level, "job %s %s %s", job_id, event, detail, extra=extra)


def log_queued(queue: str, job: Job) -> None:
    """A job reached the decode loop, after waiting in the queue."""
    waited = None if job.enqueued_at is None else max(0.0, time.time() - job.enqueued_at)
    job_event(log, "queued_wait", job.id, queue, job.attempts_before + 1, queue_wait_s=waited)


def log_started(queue: str, job: Job) -> None:
    """A job took a row and its run started."""
    job_event(
        log,
        "started",
        job.id,
        queue,
        job.attempt,
        prompt_tokens=len(job.prompt_ids),
        queue_wait_s=(
            None if job.enqueued_at is None else max(0.0, job.started_at - job.enqueued_at)
        ),
        buffered_s=job.started_mono - job.claimed_at,
    )


def log_end(queue: str, job: Job, outcome: Outcome) -> None:
    """A job the loop held settled: it ended, or the worker let go of it."""
    now = time.monotonic()
    started = bool(job.started_mono)
    failed = outcome is Outcome.FAILED
    job_event(
        log,
        "timed_out" if failed and job.timed_out else outcome.value,
        job.id,
        queue,
        job.attempt or job.attempts_before + 1,
        logging.INFO if outcome in QUIET else logging.WARNING,
        tokens=job.generated if started else None,
        prompt_tokens=len(job.prompt_ids),
        finish_reason=job.finish_reason if outcome is Outcome.FINISHED else None,
        ttft_s=None if job.first_token_at is None else job.first_token_at - job.started_mono,
        run_s=now - job.started_mono if started else None,
        e2e_s=None if job.enqueued_at is None else max(0.0, time.time() - job.enqueued_at),
        reason=(job.note or None) if outcome is not Outcome.FINISHED else None,
    )
