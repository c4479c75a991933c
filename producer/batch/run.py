"""Run or resume one batch file: open its files, pick up an earlier run, sweep, report."""

from __future__ import annotations

import contextlib
import logging
import shlex
import signal
import sys
from typing import IO, Any

import redis
from tqdm.contrib.logging import logging_redirect_tqdm

from mlxq.producer.batch import records
from mlxq.producer.batch.config import DEFAULT_MAX_IN_FLIGHT, BatchConfig
from mlxq.producer.batch.files import Journal, LineFile
from mlxq.producer.batch.lines import LineChecker, count_lines, read_lines
from mlxq.producer.batch.progress import PREFIX, Progress, Tally, summary
from mlxq.producer.batch.runner import Sweep
from mlxq.producer.batch.stop import StopFlag
from mlxq.producer.connection import connect

#: The exit status of a run stopped by a signal (as a shell reports SIGINT).
STOPPED = 130


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
        0 when every line was answered or reported; 130 when stopped (rerun to resume).

    Raises:
        BatchLocked: another run writes the same output.
        OSError: a file cannot be read or written.
    """
    stream = stream or sys.stderr
    with contextlib.ExitStack() as stack:
        out, err, journal = _open(cfg, stack)
        answered, reported = _earlier(out, err)
        if not out.existed:
            journal.discard()
        inherited = journal.load(answered)
        tally = Tally(total=count_lines(cfg.input), earlier=len(answered) + len(reported))
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
            LineChecker(cfg.queue, answered),
            reported,
            tally,
            stop or StopFlag(),
            progress.show,
        )
        if sweep.run(read_lines(cfg.input)):
            sweep.finish()
            progress.close()
            _report_done(cfg, tally, stream)
            return 0
        _report_stopped(cfg, sweep, tally, progress, stream)
        return STOPPED
