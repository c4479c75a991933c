"""Output lines in OpenAI's Batch shape, and reading them back when a run resumes.

An answered request (the worker ran it, well or not)::

    {"id": "batch_req_<job id>", "custom_id": ..., "error": null,
     "response": {"status_code": 200, "request_id": <job id>, "body": <completion>}}

A job that failed in the worker has the ``status_code`` that ``mlxq serve`` would answer
(400 for input the model cannot take, code ``context_length_exceeded`` or
``invalid_request_error``; 504 past its deadline, code ``timeout``; 500 otherwise: see
:class:`~mlxq.producer.outcome.Failure`), OpenAI's error object as its body and
``"error": {"code", "message"}``. A line that could not run
has ``"response": null`` and ``"error"`` in OpenAI's ``BatchError`` shape, with ``line``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from mlxq.producer.batch.lines import LineError
from mlxq.producer.openai_api import error_body
from mlxq.producer.outcome import Failure


def answer(custom_id: str, job_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The output line of a request the worker answered."""
    return {
        "id": f"batch_req_{job_id}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": job_id, "body": dict(body)},
        "error": None,
    }


def failure(custom_id: str, job_id: str, reason: str) -> dict[str, Any]:
    """The output line of a request whose job failed (or was canceled) in the worker."""
    kind = Failure(reason)
    message = f"job {job_id} failed: {reason}"
    return {
        "id": f"batch_req_{job_id}",
        "custom_id": custom_id,
        "response": {
            "status_code": kind.status,
            "request_id": job_id,
            "body": error_body(message, kind.type, None, kind.code),
        },
        "error": {"code": kind.code, "message": message},
    }


def line_error(e: LineError) -> dict[str, Any]:
    """The error line of an input line that could not run."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": e.custom_id,
        "response": None,
        "error": {"code": e.code, "message": e.message, "param": e.param, "line": e.line},
    }


def answered_id(record: Any) -> str | None:
    """The ``custom_id`` an output line answers, or None for any other line."""
    if not isinstance(record, Mapping) or not isinstance(record.get("response"), Mapping):
        return None
    cid = record.get("custom_id")
    return cid if isinstance(cid, str) else None


def reported_line(record: Any) -> int | None:
    """The input line number an error line reports, or None for any other line."""
    if not isinstance(record, Mapping) or record.get("response") is not None:
        return None
    error = record.get("error")
    line = error.get("line") if isinstance(error, Mapping) else None
    return line if isinstance(line, int) and not isinstance(line, bool) else None
