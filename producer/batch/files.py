"""The files a run writes, and how a later run picks them up after a crash.

- :class:`LineFile`: the output (and errors) file: JSON lines, appended whole and flushed
  only once their result was read; locked while a run writes it; a partial last line (a
  run killed mid-write) is cut off when the next run opens it.
- :class:`Journal`: ``<output>.journal``, ``custom_id -> job id`` of every job the run
  submitted, made durable (fsync) *before* the submit, so a rerun re-attaches to jobs
  still queued, running or finished instead of submitting them again. It goes when the
  sweep is complete.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Callable, Container, Iterable, Mapping
from pathlib import Path
from typing import Any

from mlxq.producer.errors import BatchLocked as BatchLocked

log = logging.getLogger("mlxq.batch")


def _encode(record: Mapping[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _named(e: OSError, path: Path) -> OSError:
    """``e`` naming ``path`` (a failed write on an open file names none)."""
    return OSError(e.errno, e.strerror, str(path))


def _append(fd: int, data: bytes, path: Path) -> None:
    """Write all of ``data`` to ``fd`` (a write may take part of it), unbuffered: when
    one fails (a full disk) nothing is left in a buffer for a later flush or the close
    to fail on again, and what did land is at most a partial last line, which the next
    run cuts off.

    Raises:
        OSError: naming ``path``.
    """
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError as e:
        raise _named(e, path) from None


def _fsync(fd: int, path: Path) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        raise _named(e, path) from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _scan(f: Any, name: Path, on_record: Callable[[Any], None]) -> int:
    """Feed each complete line of ``f`` (parsed) to ``on_record``; cut a partial last
    line off. Returns the bytes cut."""
    f.seek(0)
    end = 0
    for raw in f:
        if not raw.endswith(b"\n"):
            break
        end += len(raw)
        try:
            record = json.loads(raw)
        except ValueError:
            log.warning("%s: skipped a line that is not JSON (at byte %d)", name, end - len(raw))
            continue
        on_record(record)
    size = os.fstat(f.fileno()).st_size
    if end < size:
        f.truncate(end)
        log.warning("%s: cut off a partial last line (%d bytes) of a stopped run", name, size - end)
    f.seek(0, os.SEEK_END)
    return size - end


class LineFile:
    """A JSON-lines file a run appends to, locked against a second run.

    Args:
        path: Created if missing; an existing file is kept (a resumed run adds to it).

    Raises:
        BatchLocked: another run holds the file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.existed = path.exists()
        self._f = path.open("ab+")  # O_APPEND: a write lands after everything written
        try:
            fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.close()
            raise BatchLocked(f"{path}: another mlxq run-batch is writing it") from None
        self.dirty = False

    def scan(self, on_record: Callable[[Any], None]) -> int:
        """Feed every complete line to ``on_record``, first to last; cut a partial last
        line off. Returns the bytes cut."""
        return _scan(self._f, self.path, on_record)

    def write(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Append whole lines and flush them to the OS (they survive a kill of this
        process; :meth:`sync` makes them survive a crash of the machine)."""
        data = b"".join(_encode(r) for r in records)
        if data:
            self.dirty = True
            _append(self._f.fileno(), data, self.path)  # O_APPEND: after all there is

    def sync(self) -> None:
        if self.dirty:
            # Clean even when it fails: the kernel reports a failed writeback once, so a
            # second fsync would pass without the data being there.
            self.dirty = False
            _fsync(self._f.fileno(), self.path)

    def close(self) -> None:
        try:
            self.sync()
        finally:
            self._f.close()  # and the lock with it


class Journal:
    """``custom_id -> job id`` of the jobs a run submitted; see the module docstring.

    Args:
        path: ``<output>.journal``.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f: Any = None

    def load(self, answered: Container[str]) -> dict[str, str]:
        """The entries whose ``custom_id`` has no output line yet (the last entry of each
        wins); the file is rewritten with only those (atomically), then opened to append.
        """
        entries: dict[str, str] = {}

        def take(record: Any) -> None:
            cid, job_id = _entry(record)
            if cid is None or job_id is None:
                return
            if cid in answered:
                entries.pop(cid, None)
            else:
                entries[cid] = job_id

        if self.path.exists():
            with self.path.open("rb+") as old:
                _scan(old, self.path, take)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("wb", buffering=0) as new:
            data = b"".join(_encode({"custom_id": c, "job_id": j}) for c, j in entries.items())
            _append(new.fileno(), data, tmp)
            _fsync(new.fileno(), tmp)
        os.replace(tmp, self.path)
        _fsync_dir(self.path)
        self._f = self.path.open("ab", buffering=0)
        return entries

    def discard(self) -> None:
        """Forget a journal left by an earlier run (whose output is gone)."""
        if self.path.exists():
            log.warning("%s: removed (its output file is gone: a fresh run)", self.path)
            self.path.unlink()

    def record(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Make ``(custom_id, job id)`` pairs durable; call before submitting them."""
        data = b"".join(_encode({"custom_id": c, "job_id": j}) for c, j in pairs)
        _append(self._f.fileno(), data, self.path)
        _fsync(self._f.fileno(), self.path)

    def remove(self) -> None:
        """The sweep is complete (its output synced): nothing is left to re-attach to."""
        if self._f is not None:
            self._f.close()
            self._f = None
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _entry(record: Any) -> tuple[str | None, str | None]:
    if not isinstance(record, Mapping):
        return None, None
    cid, job_id = record.get("custom_id"), record.get("job_id")
    return (cid if isinstance(cid, str) else None), (job_id if isinstance(job_id, str) else None)
