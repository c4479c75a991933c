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

from mlxq.producer.batch.config import DEFAULT_MAX_LINE_BYTES
from mlxq.producer.errors import InvalidRequest
from mlxq.producer.openai_api import ENDPOINTS, OpenAIRequest, parse_request

log = logging.getLogger("mlxq.batch")

MAX_CUSTOM_ID_CHARS = 512
#: Bytes held at a time while reading past a line over the cap.
SKIP_CHUNK = 1 << 20
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
            ``invalid_method``, ``invalid_url``, ``invalid_request`` or ``line_too_long``.
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


@dataclass(frozen=True, slots=True)
class LongLine:
    """An input line longer than the cap: only its size is known (its bytes were read
    past, never held)."""

    size: int


class LineReader:
    """A file's (or a stream's) lines with their numbers (from 1), read as a stream: a
    line longer than ``max_line_bytes`` (its newline not counted) comes as a
    :class:`LongLine`, so one line never holds more memory than the cap, however long
    it is (a 2 GB line, an endless stream without a newline).

    Attributes:
        offset: Bytes read so far (the reader's place in the input).
    """

    def __init__(self, path: Path, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        if isinstance(max_line_bytes, bool) or not isinstance(max_line_bytes, int):
            raise ValueError(f"max_line_bytes={max_line_bytes!r}: must be an integer")
        if max_line_bytes < 1:
            raise ValueError(f"max_line_bytes={max_line_bytes!r}: must be >= 1")
        self.path, self.cap = path, max_line_bytes
        self.offset = 0

    def __iter__(self) -> Iterator[tuple[int, bytes | LongLine]]:
        with self.path.open("rb") as f:
            n = 0
            while raw := f.readline(self.cap + 1):  # at most the cap and a newline
                n += 1
                self.offset += len(raw)
                if len(raw) <= self.cap or raw.endswith(b"\n"):
                    yield n, raw
                    continue
                size = len(raw)
                while not raw.endswith(b"\n") and (raw := f.readline(SKIP_CHUNK)):
                    size += len(raw)
                    self.offset += len(raw)
                yield n, LongLine(size - raw.endswith(b"\n"))


def count_lines(path: Path, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> int:
    """Lines that are not blank, counted in one streaming pass (bounded as a sweep reads)."""
    lines = LineReader(path, max_line_bytes)
    return sum(isinstance(raw, LongLine) or bool(raw.strip()) for _, raw in lines)


class LineChecker:
    """Checks input lines in order; remembers the ``custom_id`` s seen, for duplicates.

    Args:
        queue: Run every line on this queue (``--queue``); None: each line's ``body.model``.
        answered: ``custom_id`` s that already have an output line (a resumed run): their
            lines are counted (``skipped``) but neither checked further nor run.
        max_line_bytes: The cap :class:`LineReader` read with (named in the error of a
            :class:`LongLine`).
    """

    def __init__(
        self,
        queue: str | None = None,
        answered: Container[str] = (),
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    ) -> None:
        self.queue = queue
        self.max_line_bytes = max_line_bytes
        self.answered = answered
        self.seen: dict[str, int] = {}  # custom_id -> the line it was first seen on
        self.skipped = 0
        self._warned: set[str] = set()

    def check(self, line: int, raw: bytes | LongLine) -> Request | LineError | None:
        """One line: a request to run, why it cannot run, or None (blank, or answered)."""
        if isinstance(raw, LongLine):
            message = (
                f"the line is {raw.size} bytes, over max_line_bytes={self.max_line_bytes} "
                "(--max-line-bytes): skipped unread"
            )
            return LineError(line, None, "line_too_long", message)
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
