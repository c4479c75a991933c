"""The one message codec: msgpack for rq's job data and results, and for stream chunks.

Nothing mlxq reads from Redis is ever unpickled: rq is handed
:class:`MsgpackSerializer` on both sides, and chunks are msgpack maps checked
field by field on decode.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import msgpack

from mlxq.producer import keys
from mlxq.producer.errors import PayloadError

#: What a chunk is. ``tokens`` carries text; ``error`` ends a failed job;
#: ``reset`` says a new attempt starts and text from earlier attempts is void.
CHUNK_KINDS = ("tokens", "error", "reset")
FINISH_REASONS = ("stop", "length", "canceled", "error")
#: Each run of a job numbers its chunks from its own base: run ``a`` writes seq
#: ``(a - 1) * SEQ_PER_ATTEMPT + 1, + 2, ...``, so a re-run never collides with what an
#: earlier run wrote, and within a run seqs are consecutive (a listener sees gaps).
SEQ_PER_ATTEMPT = 1 << 20
#: Largest job data (rq's zlib-compressed envelope) and its decompressed size the worker
#: reads; anything larger fails by that reason before it is decoded.
MAX_JOB_DATA_BYTES = 8 << 20
#: What a pub/sub message on a job's channel is when it is not a chunk: "the job's state
#: changed, read it" (msgpack nil).
NOTICE = b"\xc0"


def first_seq(attempt: int) -> int:
    """The seq of the first chunk a job's run number ``attempt`` (1, 2, ...) writes."""
    return (attempt - 1) * SEQ_PER_ATTEMPT + 1


class MsgpackSerializer:
    """rq serializer (any object with ``dumps``/``loads``); tuples come back as lists."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]

    @staticmethod
    def loads(data: bytes) -> Any:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of one job's output, as streamed.

    Attributes:
        seq: 1, 2, 3... per job (a re-run numbers from its own base, see
            :func:`first_seq`); listeners dedupe and order by it.
        text: Text decoded from ``token_ids`` (never a split multi-byte character).
        token_ids: The tokens this chunk adds.
        finish_reason: None except on the last chunk of a choice: ``"stop"``,
            ``"length"``, ``"canceled"`` or ``"error"``.
        kind: ``"tokens"``, ``"error"`` (``error`` says why) or ``"reset"``.
        attempt: Which run of the job made it (1 unless the job was re-run).
        usage: On the job's last chunk, ``{"prompt_tokens", "completion_tokens"}``.
        error: The failure reason, for ``kind == "error"``.
        index: Which choice the text belongs to (jobs with ``n > 1``).
        logprobs: With ``logprobs=True``, one entry per token of ``token_ids``:
            ``{"token", "logprob", "bytes", "top_logprobs": [...]}``.
        done: Whether this is the job's last chunk; None reads as "it ends a
            choice", which for one choice is the same thing.
    """

    seq: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    kind: str = "tokens"
    attempt: int = 1
    usage: dict[str, int] | None = None
    error: str | None = None
    index: int = 0
    logprobs: list[dict[str, Any]] | None = None
    done: bool | None = None

    @property
    def final(self) -> bool:
        """The job's last chunk: its stream ends here."""
        return self.finish_reason is not None if self.done is None else self.done


def encode_chunk(c: Chunk) -> bytes:
    m: dict[str, Any] = {"s": c.seq, "k": c.kind, "a": c.attempt, "t": c.text, "i": c.token_ids}
    if c.finish_reason is not None:
        m["f"] = c.finish_reason
    if c.usage is not None:
        m["u"] = c.usage
    if c.error is not None:
        m["e"] = c.error
    if c.index:
        m["n"] = c.index
    if c.logprobs is not None:
        m["l"] = c.logprobs
    if c.done is not None:
        m["d"] = c.done
    return msgpack.packb(m, use_bin_type=True)  # type: ignore[no-any-return]


def decode_message(data: bytes) -> Chunk | None:
    """A pub/sub message of a job's channel: its chunk, or None for a :data:`NOTICE`.

    Raises:
        PayloadError: neither (a rogue message; listeners skip it and read the log).
    """
    if data == NOTICE:
        return None
    return decode_chunk(data)


def decode_chunk(data: bytes) -> Chunk:
    """Decode and check a chunk read from Redis.

    Raises:
        PayloadError: if the bytes are not a well-formed chunk.
    """
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        raise PayloadError(f"chunk: undecodable msgpack ({e})") from None
    if not isinstance(m, dict):
        raise PayloadError(f"chunk={m!r}: must be a map")
    seq, kind, attempt = m.get("s"), m.get("k"), m.get("a", 1)
    text, ids, fin = m.get("t", ""), m.get("i", []), m.get("f")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise PayloadError(f"chunk.seq={seq!r}: must be an integer >= 1")
    if kind not in CHUNK_KINDS:
        raise PayloadError(f"chunk.kind={kind!r}: must be one of {CHUNK_KINDS}")
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
        raise PayloadError(f"chunk.attempt={attempt!r}: must be an integer >= 1")
    if not isinstance(text, str):
        raise PayloadError(f"chunk.text={text!r}: must be a string")
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise PayloadError(f"chunk.token_ids={ids!r}: must be a list of integers")
    if fin is not None and fin not in FINISH_REASONS:
        raise PayloadError(f"chunk.finish_reason={fin!r}: must be one of {FINISH_REASONS}")
    usage, error = m.get("u"), m.get("e")
    if usage is not None and not (
        isinstance(usage, dict) and all(type(n) is int for n in usage.values())
    ):
        raise PayloadError(f"chunk.usage={usage!r}: must be a map of token counts")
    if error is not None and not isinstance(error, str):
        raise PayloadError(f"chunk.error={error!r}: must be a string")
    index, logprobs, done = _extras(m)
    return Chunk(seq, text, ids, fin, kind, attempt, usage, error, index, logprobs, done)


def _extras(m: dict[str, Any]) -> tuple[int, list[dict[str, Any]] | None, bool | None]:
    index, logprobs, done = m.get("n", 0), m.get("l"), m.get("d")
    if type(index) is not int or not 0 <= index < 1024:
        raise PayloadError(f"chunk.index={index!r}: must be a small integer >= 0")
    if logprobs is not None and not (
        isinstance(logprobs, list) and all(isinstance(e, dict) for e in logprobs)
    ):
        raise PayloadError("chunk.logprobs: must be a list of maps")
    if done is not None and not isinstance(done, bool):
        raise PayloadError(f"chunk.done={done!r}: must be true or false")
    return index, logprobs, done


def decode_job_data(raw: bytes, limit: int = MAX_JOB_DATA_BYTES) -> Any:
    """The payload map inside an rq job's stored ``data``, read with a size limit.

    rq stores ``zlib(serializer.dumps((func, instance, args, kwargs)))`` (or the bytes
    uncompressed); a zlib bomb is refused by size before it is inflated.

    Raises:
        PayloadError: naming what is wrong (size, compression, envelope, function).
    """
    if len(raw) > limit:
        raise PayloadError(f"job data: {len(raw)} bytes, at most {limit}")
    try:
        inflater = zlib.decompressobj()
        data = inflater.decompress(raw, limit)
        if inflater.unconsumed_tail:
            raise PayloadError(f"job data: inflates past {limit} bytes")
    except zlib.error:
        data = raw  # rq's own fallback: data stored uncompressed
    try:
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        raise PayloadError(f"job data: not mlxq msgpack ({type(e).__name__})") from None
    if not isinstance(envelope, list) or len(envelope) != 4:
        raise PayloadError("job data: not an rq job envelope (func, instance, args, kwargs)")
    func, _, args, kwargs = envelope
    if func != keys.JOB_FUNC:
        raise PayloadError(f"func={func!r}: not an mlxq job (want {keys.JOB_FUNC!r})")
    if kwargs or not isinstance(args, list) or len(args) != 1:
        raise PayloadError("job args: want exactly one payload map")
    return args[0]
