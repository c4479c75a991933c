"""Input lines of an OpenAI Batch file -> runnable requests, or the reason a line cannot run.

A line is ``{"custom_id": str, "method": "POST", "url": <endpoint>, "body": {...}}``. The
body goes through the same mapping as ``mlxq serve``
(:func:`mlxq.producer.openai_api.parse_request`), so a body means one thing to both.
Checks run in the order a reader would: JSON, ``custom_id`` (present, a string, not seen
on an earlier line), then ``method``, ``url`` and the body. No Redis here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxq.producer.errors import InvalidRequest
from mlxq.producer.openai_api import ENDPOINTS, OpenAIRequest, parse_request

log = logging.getLogger("mlxq.batch")

MAX_CUSTOM_ID_CHARS = 512
LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})


@dataclass(frozen=True, slots=True)
class Request:
    """One runnable input line.

    Attributes:
        line: Its line number in the input (from 1).
        custom_id: The caller's id for it; its output line carries the same.
        queue: The queue that runs it (``body.model``, or ``--queue``).
        req: The checked request; ``req.submit`` are its submit arguments.
    """

    line: int
    custom_id: str
    queue: str
    req: OpenAIRequest

    def __post_init__(self) -> None:
        if self.line < 1:
            raise ValueError(f"line={self.line!r}: must be >= 1")


@dataclass(frozen=True, slots=True)
class LineError:
    """Why an input line cannot run (OpenAI's ``BatchError`` fields).

    Attributes:
        line: Its line number in the input (from 1).
        custom_id: The line's ``custom_id`` when it had a usable one.
        code: ``invalid_json_line``, ``missing_custom_id``, ``duplicate_custom_id``,
            ``invalid_method``, ``invalid_url`` or ``invalid_request``.
        message: What is wrong, naming the field.
        param: The field at fault, when one is.
    """

    line: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None

    def __post_init__(self) -> None:
        if self.line < 1:
            raise ValueError(f"line={self.line!r}: must be >= 1")


def read_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """The file's lines with their numbers (from 1), read as a stream."""
    with path.open("rb") as f:
        yield from enumerate(f, start=1)


def count_lines(path: Path) -> int:
    """Lines that are not blank, counted in one streaming pass."""
    n = 0
    with path.open("rb") as f:
        for raw in f:
            n += bool(raw.strip())
    return n


class LineChecker:
    """Checks input lines in order; remembers the ``custom_id`` s seen, for duplicates.

    Args:
        queue: Run every line on this queue (``--queue``); None: each line's ``body.model``.
        answered: ``custom_id`` s that already have an output line (a resumed run): their
            lines are counted (``skipped``) but neither checked further nor run.
    """

    def __init__(self, queue: str | None = None, answered: Container[str] = ()) -> None:
        self.queue = queue
        self.answered = answered
        self.seen: dict[str, int] = {}  # custom_id -> the line it was first seen on
        self.skipped = 0
        self._warned: set[str] = set()

    def check(self, line: int, raw: bytes) -> Request | LineError | None:
        """One line: a request to run, why it cannot run, or None (blank, or answered)."""
        if not raw.strip():
            return None
        try:
            obj = json.loads(raw)
        except ValueError as e:  # bad JSON, or bytes that are not UTF-8
            return LineError(line, None, "invalid_json_line", f"not a JSON line: {e}")
        if not isinstance(obj, Mapping):
            return LineError(line, None, "invalid_json_line", "a line must be a JSON object")
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not 0 < len(cid) <= MAX_CUSTOM_ID_CHARS:
            if cid is None:
                message = "custom_id: required"
            else:
                message = f"custom_id={_short(cid)}: must be a string of 1 to "
                message += f"{MAX_CUSTOM_ID_CHARS} characters"
            return LineError(line, None, "missing_custom_id", message, "custom_id")
        first = self.seen.setdefault(cid, line)
        if first != line:
            message = f"custom_id={cid!r}: a duplicate of line {first}'s"
            return LineError(line, cid, "duplicate_custom_id", message, "custom_id")
        if cid in self.answered:
            self.skipped += 1
            return None
        return self._request(line, cid, obj)

    def _request(self, line: int, cid: str, obj: Mapping[str, Any]) -> Request | LineError:
        for k in obj:
            if k not in LINE_FIELDS and k not in self._warned:
                self._warned.add(k)
                log.warning("ignoring input field %r (line %d): not part of a batch line", k, line)
        method = obj.get("method", "POST")
        if method != "POST":
            message = f"method={_short(method)}: must be 'POST'"
            return LineError(line, cid, "invalid_method", message, "method")
        url = obj.get("url")
        if url not in ENDPOINTS:
            message = f"url={_short(url)}: must be one of {', '.join(ENDPOINTS)}"
            return LineError(line, cid, "invalid_url", message, "url")
        body = obj.get("body")
        if not isinstance(body, Mapping):
            message = f"body={_short(body)}: must be a JSON object"
            return LineError(line, cid, "invalid_request", message, "body")
        if body.get("stream") not in (None, False):
            message = "body.stream: a batch does not stream; leave it out"
            return LineError(line, cid, "invalid_request", message, "stream")
        if self.queue is not None and body.get("model") is None:
            body = {**body, "model": self.queue}
        try:
            req = parse_request(body, url)
        except InvalidRequest as e:
            return LineError(line, cid, "invalid_request", str(e), e.param)
        return Request(line, cid, self.queue or req.model, req)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:80]}..."
