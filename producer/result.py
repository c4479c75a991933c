"""A finished job's output, and how it is read back from rq's result log.

rq keeps each run's outcome as an entry of the job's result stream: a successful run's
return value (msgpack, base64) or a failed run's reason (zlib, base64). The newest entry
is the job's answer.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from mlxq.producer import keys
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.errors import MlxqError

#: Most bytes of a failure reason read back (rq stores it compressed: never inflated
#: past this, whatever a rogue record holds).
MAX_REASON_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Choice:
    """One sample of a job's prompt (a job asking ``n=3`` has three).

    Attributes:
        index: 0 to n - 1.
        text, token_ids, finish_reason: As :class:`Result`'s, for this sample.
        logprobs: With ``logprobs=True``, one entry per token of ``token_ids``, in
            OpenAI's chat shape: ``{"token", "logprob", "bytes", "top_logprobs":
            [{"token", "logprob", "bytes"}, ...]}``; else None.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class Result:
    """A finished job's output.

    Attributes:
        text: The whole completion (of the first choice when ``n > 1``).
        token_ids: Its tokens (without the end-of-sequence token).
        finish_reason: ``"stop"`` (end of sequence, a stop string or stop token) or
            ``"length"``.
        usage: ``{"prompt_tokens": int, "completion_tokens": int}`` (every choice's).
        choices: Every sample, ``choices[0]`` being the one above.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, int]
    choices: list[Choice] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.choices:
            object.__setattr__(
                self, "choices", [Choice(0, self.text, self.token_ids, self.finish_reason)]
            )

    @property
    def logprobs(self) -> list[dict[str, Any]] | None:
        return self.choices[0].logprobs

    @classmethod
    def from_value(cls, v: Any) -> Result:
        if not isinstance(v, Mapping):
            raise MlxqError(f"result={v!r}: not an mlxq result")
        raw = v.get("choices") or [{**v, "index": 0}]
        choices = [
            Choice(
                int(c["index"]),
                c["text"],
                list(c["token_ids"]),
                c["finish_reason"],
                c.get("logprobs"),
            )
            for c in raw
        ]
        first = choices[0]
        return cls(first.text, first.token_ids, first.finish_reason, dict(v["usage"]), choices)


def _latest_result(connection: redis.Redis, job_id: str) -> dict[bytes, bytes] | None:
    return latest_fields(connection.xrevrange(keys.results_key(job_id), count=1))


def latest_fields(entries: Any) -> dict[bytes, bytes] | None:
    """The fields of the newest entry of an XREVRANGE reply of rq's result log."""
    return dict(entries[0][1]) if entries else None


def value_of(fields: dict[bytes, bytes] | None) -> Any:
    """The return value in a successful rq result entry, or None."""
    if not fields or fields.get(b"type") != b"1" or b"return_value" not in fields:
        return None
    return MsgpackSerializer.loads(base64.b64decode(fields[b"return_value"]))


def reason_of(fields: dict[bytes, bytes] | None) -> str:
    """The last line of a failed rq result entry's reason, inflated with a size limit."""
    raw = (fields or {}).get(b"exc_string")
    if not raw:
        return "unknown"
    try:
        text = zlib.decompressobj().decompress(base64.b64decode(raw), MAX_REASON_BYTES)
    except (ValueError, zlib.error):
        return "unknown (its failure record is unreadable)"
    lines = text.decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else "unknown"


def latest_value(connection: redis.Redis, job_id: str) -> Any:
    """The return value of the job's latest successful run (rq's result log), or None."""
    return value_of(_latest_result(connection, job_id))


def latest_failure(connection: redis.Redis, job_id: str) -> str:
    """The last line of the job's latest failure reason, read with a size limit."""
    return reason_of(_latest_result(connection, job_id))
