"""Run or resume one batch file: open its files, pick up an earlier run, sweep, report."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import sys
from typing import IO, Any

import redis
from tqdm.contrib.logging import logging_redirect_tqdm

from mlxq.producer.batch import records
from mlxq.producer.batch.config import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_LINE_BYTES, BatchConfig
from mlxq.producer.batch.files import Journal, LineFile
from mlxq.producer.batch.lines import LineChecker, LineReader, count_lines
from mlxq.producer.batch.progress import PREFIX, Progress, Tally, summary
from mlxq.producer.batch.runner import Sweep
from mlxq.producer.batch.stop import StopFlag
from mlxq.producer.connection import connect

#: The exit status of a run stopped by a signal (as a shell reports SIGINT).
STOPPED = 130
#: The exit status of a run that could not finish: a file could not be written (a full
#: disk), or the input ended short of what it held at the start. A rerun resumes it.
INCOMPLETE = 1


def resume_command(cfg: BatchConfig) -> str:
    """The command line that resumes ``cfg``'s sweep (Redis URL left out: it may hold a
    password)."""
    parts = ["mlxq", "run-batch", "--input", str(cfg.input), "--output", str(cfg.output)]
    if cfg.separate_errors:
        parts += ["--errors", str(cfg.errors)]
    if cfg.queue is not None:
        parts += ["--queue", cfg.queue]
    if cfg.max_in_flight != DEFAULT_MAX_IN_FLIGHT:
        parts += ["--max-in-flight", str(cfg.max_in_flight)]
    if cfg.max_line_bytes != DEFAULT_MAX_LINE_BYTES:
        parts += ["--max-line-bytes", str(cfg.max_line_bytes)]
    if cfg.detach:
        parts.append("--detach")
    return shlex.join(parts)


def _earlier(out: LineFile, err: LineFile) -> tuple[set[str], set[int]]:
    """``custom_id`` s the output answers, and input lines already reported unrunnable."""
    answered: set[str] = set()
    reported: set[int] = set()

    def take(record: Any) -> None:
        if (cid := records.answered_id(record)) is not None:
            answered.add(cid)
        elif (line := records.reported_line(record)) is not None:
            reported.add(line)

    out.scan(take)
    if err is not out:
        err.scan(take)
    return answered, reported


def _open(cfg: BatchConfig, stack: contextlib.ExitStack) -> tuple[LineFile, LineFile, Journal]:
    """The output, the errors (the output itself unless separate) and the journal, each
    closed when ``stack`` is."""
    out = stack.enter_context(contextlib.closing(LineFile(cfg.output)))
    err = out
    if cfg.separate_errors:
        assert cfg.errors is not None
        err = stack.enter_context(contextlib.closing(LineFile(cfg.errors)))
    journal = Journal(cfg.journal)
    stack.callback(journal.close)
    return out, err, journal


def _report_done(cfg: BatchConfig, tally: Tally, stream: IO[str]) -> None:
    print(f"{PREFIX}: {summary(tally)}", file=stream)
    where = f"{PREFIX}: output {cfg.output}"
    if cfg.separate_errors:
        where += f", errors {cfg.errors}"
    print(where, file=stream)


def _report_stopped(
    cfg: BatchConfig, sweep: Sweep, tally: Tally, progress: Progress, stream: IO[str]
) -> None:
    """Settle the jobs in flight as ``cfg`` asks and say how the sweep resumes."""
    left, canceled = sweep.interrupt()
    progress.close()
    name = signal.Signals(sweep.stop.signum).name if sweep.stop.signum else "a stop"
    print(f"{PREFIX}: stopped by {name}: {progress.line()}", file=stream)
    if left:
        fate = "canceled" if canceled else "left running (a rerun collects them)"
        print(f"{PREFIX}: {left} jobs in flight {fate}", file=stream)
    print(f"{PREFIX}: {summary(tally)}", file=stream)
    print(f"{PREFIX}: resume with: {resume_command(cfg)}", file=stream)


def _report_short(cfg: BatchConfig, sweep: Sweep, tally: Tally, stream: IO[str]) -> None:
    """Every line read was answered, but the input ended short: not complete."""
    sweep.out.sync()
    sweep.err.sync()
    sweep.journal.close()  # kept: a rerun with the whole input collects what it names
    print(f"{PREFIX}: not complete: {sweep.short}", file=stream)
    print(f"{PREFIX}: {summary(tally)}", file=stream)
    print(f"{PREFIX}: when the input is whole, resume with: {resume_command(cfg)}", file=stream)


def _report_write_failed(
    cfg: BatchConfig, sweep: Sweep, tally: Tally, progress: Progress, e: OSError, stream: IO[str]
) -> None:
    """A write failed (a full disk): stop where the files stand. The jobs in flight are
    journaled and keep running, for the rerun to collect; what did not reach the output
    is answered then (a partial last line is cut off)."""
    sweep.abandon()
    progress.close()
    print(f"{PREFIX}: stopped: {e.filename or 'a file'}: {e.strerror or e}", file=stream)
    if sweep.flights:
        print(f"{PREFIX}: {len(sweep.flights)} jobs in flight left running", file=stream)
    print(f"{PREFIX}: {summary(tally)}", file=stream)
    print(f"{PREFIX}: when there is room, resume with: {resume_command(cfg)}", file=stream)


def run_batch(
    cfg: BatchConfig,
    connection: redis.Redis | None = None,
    stream: IO[str] | None = None,
    stop: StopFlag | None = None,
) -> int:
    """Run a batch file, or resume it where an earlier run (stopped or killed) left off.

    Args:
        cfg: What to run.
        connection: Redis to use instead of ``cfg.redis_url``.
        stream: Where progress and the summary go (stderr).
        stop: A stop flag of the caller's; None: one that SIGINT / SIGTERM set.

    Returns:
        0 when every line was answered or reported; 130 when stopped; 1 when a file could
        not be written (a full disk) or the input ended short of what it held at the start
        (each said on ``stream``). Rerun to resume.

    Raises:
        BatchLocked: another run writes the same output.
        OSError: a file cannot be opened, or written before the sweep starts.
    """
    stream = stream or sys.stderr
    with contextlib.ExitStack() as stack:
        out, err, journal = _open(cfg, stack)
        answered, reported = _earlier(out, err)
        if not out.existed:
            journal.discard()
        inherited = journal.load(answered)
        # The size first: a file cut while it is counted reads as cut.
        size = None if cfg.streamed else os.stat(cfg.input).st_size
        total = None if cfg.streamed else count_lines(cfg.input, cfg.max_line_bytes)
        tally = Tally(total=total, earlier=len(answered) + len(reported))
        progress = Progress(tally, cfg.progress, cfg.progress_every_s, stream)
        stack.callback(progress.close)
        if progress.bar is not None:
            stack.enter_context(logging_redirect_tqdm([logging.getLogger("mlxq")]))
        sweep = Sweep(
            cfg,
            connection or connect(cfg.redis_url, retries=0),
            out,
            err,
            journal,
            inherited,
            LineChecker(cfg.queue, answered, cfg.max_line_bytes),
            reported,
            tally,
            stop or StopFlag(),
            progress.show,
        )
        try:
            return _sweep(cfg, sweep, tally, progress, size, stream)
        except OSError as e:
            _report_write_failed(cfg, sweep, tally, progress, e, stream)
            return INCOMPLETE


def _sweep(
    cfg: BatchConfig,
    sweep: Sweep,
    tally: Tally,
    progress: Progress,
    size: int | None,
    stream: IO[str],
) -> int:
    """Run the sweep and report how it ended; its exit status."""
    if not sweep.run(LineReader(cfg.input, cfg.max_line_bytes), size):
        _report_stopped(cfg, sweep, tally, progress, stream)
        return STOPPED
    if sweep.short is not None:
        progress.close()
        _report_short(cfg, sweep, tally, stream)
        return INCOMPLETE
    sweep.finish()
    progress.close()
    _report_done(cfg, tally, stream)
    return 0
