"""Which model a worker serves, as a cheap fingerprint, and the live workers of its queues
that serve another.

Two workers on one queue with different models give a job different answers depending
on which claims it, with nothing to tell. So each worker publishes its model's digest
with its stats (``model_digest``, beside ``model``, the path or repo id it was given; see
``mlxq info --json``), and a starting worker compares its own with those of the live
workers on the queues it serves: :func:`mismatches`.

The digest is the model, not its path (the same model at two paths, on two machines, is
the same): every small file of the model directory whole (config, tokenizer, chat
template, generation config) and, of each weights file, its name, size and three 64 KiB
samples (start, middle, end), so a fine-tune of the same shape differs, and the cost is
a few reads, not a pass over gigabytes.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from mlxq.producer import keys
from mlxq.producer.codec import MsgpackSerializer

log = logging.getLogger("mlxq.worker")

#: Files hashed whole: the model's configuration, tokenizer and chat template.
WHOLE = (".json", ".jinja", ".txt", ".model", ".tiktoken")
#: Weights files, sampled.
WEIGHTS = (".safetensors", ".npz", ".gguf", ".bin")
#: Bytes read at each of a weights file's three samples.
SAMPLE_BYTES = 64 * 1024
#: A file named ``WHOLE`` larger than this is sampled too (no config is this large).
MAX_WHOLE_BYTES = 64 * 1024 * 1024
#: Hex digits of the digest kept: plenty to tell models apart.
DIGEST_CHARS = 16
#: The longest stats record read from another worker (they are a few KiB).
MAX_STATS_BYTES = 1 << 20


def _sampled(h: Any, path: Path, size: int) -> None:
    with path.open("rb") as f:
        for at in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
            f.seek(at)
            h.update(f.read(SAMPLE_BYTES))


def directory_digest(directory: Path) -> str:
    """The fingerprint of the model in ``directory`` (see the module docstring)."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        suffix = path.suffix.lower()
        if suffix not in WHOLE and suffix not in WEIGHTS:
            continue  # a README, a picture, the repo's .gitattributes: no answer depends on it
        size = path.stat().st_size
        h.update(f"{name}\0{size}\0".encode())
        if suffix in WHOLE and size <= MAX_WHOLE_BYTES:
            h.update(path.read_bytes())
        else:
            _sampled(h, path, size)
    return h.hexdigest()[:DIGEST_CHARS]


def model_directory(model: str) -> Path | None:
    """Where ``model`` (a path or a Hugging Face repo id) is on disk; None for a repo not
    downloaded yet."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from mlx_lm.utils import hf_repo_to_path

        return Path(hf_repo_to_path(model))
    except Exception:  # not in the local cache (yet): mlx-lm downloads it when it loads
        return None


def model_digest(model: str) -> str | None:
    """``model``'s fingerprint, or None while a repo id is not downloaded."""
    directory = model_directory(model)
    return None if directory is None else directory_digest(directory)


@dataclass(frozen=True, slots=True)
class Other:
    """A live worker of one of the queues, serving another model."""

    worker: str
    queue: str
    model: str
    digest: str


def _stats(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, bytes) or len(raw) > MAX_STATS_BYTES:
        return None
    try:
        stats = MsgpackSerializer.loads(raw)
    except Exception:
        return None
    return stats if isinstance(stats, dict) else None


def mismatches(
    connection: redis.Redis, worker: str, queues: Sequence[str], digest: str
) -> list[Other]:
    """The live workers (lease held) on the rolls of ``queues`` whose published model
    digest is not ``digest``. A worker that publishes none (an older version, one that
    has not published yet) or whose record cannot be read is left out: this is a check
    against a mistake, not a lock."""
    found: list[Other] = []
    for queue in queues:
        try:
            names = sorted(
                n.decode("utf-8", "replace")
                for n in connection.smembers(keys.workers_key(queue))
                if isinstance(n, bytes)
            )
        except redis.ResponseError as e:  # a roll of another type: nothing to compare with
            log.warning("could not read the workers of queue %r (%s): not compared", queue, e)
            continue
        names = [n for n in names if n != worker]
        with connection.pipeline(transaction=False) as p:
            for name in names:
                p.exists(keys.alive_key(name))
                p.hget(keys.worker_stats_key(name), "stats")
            replies = p.execute(raise_on_error=False)
        for i, name in enumerate(names):
            alive, stats = replies[2 * i], _stats(replies[2 * i + 1])
            if not isinstance(alive, int) or alive <= 0:  # no lease (or an error): not live
                continue
            if stats is None:
                continue
            theirs = stats.get("model_digest")
            if isinstance(theirs, str) and theirs and theirs != digest:
                model = str(stats.get("model", "?"))[:200]
                found.append(Other(name[:200], queue, model, theirs[:64]))
    return found


def mismatch_text(model: str, digest: str, others: Sequence[Other]) -> str:
    """The one line a worker refusing to start says."""
    shown = "; ".join(
        f"worker {o.worker} on queue {o.queue!r}: {o.model} ({o.digest})" for o in others[:3]
    )
    more = f" and {len(others) - 3} more" if len(others) > 3 else ""
    return (
        f"this worker's model {model} ({digest}) is not the one live workers of its queues "
        f"serve ({shown}{more}): a job's answer would depend on which worker took it. Serve "
        "another queue, or pass --allow-mixed-models (MLXQ_ALLOW_MIXED_MODELS=1) to serve "
        "it anyway"
    )
