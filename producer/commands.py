"""``mlxq submit | status | result | stream | jobs | info``: jobs and queues from the shell
(``cancel``, ``retry`` and ``purge`` are :mod:`mlxq.producer.control`).

Each ``add_X`` function adds command X's arguments to its parser (every option's help
shows its default; ``submit``'s request options come from the request's fields), and
``run_X`` carries it out. Errors are raised, not printed: the ``mlxq`` entry turns them
into one line and an exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from datetime import datetime, timezone

import redis
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from mlxq.producer import listing
from mlxq.producer.client import Client
from mlxq.producer.connection import connect
from mlxq.producer.errors import JobTimeout, NoSuchJob
from mlxq.producer.fields import flags
from mlxq.producer.info import collect, duration, render
from mlxq.producer.job import Job
from mlxq.producer.params import GenerationRequest
from mlxq.producer.terminal import StreamPrinter, for_terminal
from mlxq.producer.throttle import Throttle


def _wait_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds to wait for {what}; the job goes on after (default: as long as it takes)",
    )


def add_submit(s: argparse.ArgumentParser) -> None:
    s.description = (
        "Queue one generation job. Without --stream, print its id on stdout; "
        "with --stream, print the id on stderr, then the text as it is made."
    )
    s.add_argument(
        "prompt", help="the prompt; '-' reads it from stdin (one trailing newline dropped)"
    )
    s.add_argument("--queue", default="default", help="queue to submit to (default: %(default)s)")
    for name, flag, kw in flags(GenerationRequest):
        if name == "timeout":  # where --help has always listed the output switches
            _output_switches(s)
        s.add_argument(flag, **kw)
    _wait_arg(s, "the streamed job's end")
    s.add_argument(
        "--cancel-on-exit",
        action="store_true",
        help="with --stream: cancel the job when this command stops before its end "
        "(Ctrl-C, --wait passed); without it the job goes on (default: off)",
    )


def _output_switches(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--chat", action="store_true", help="send the prompt as one user message (default: off)"
    )
    s.add_argument(
        "--stream", action="store_true", help="stream the text as it is made (default: off)"
    )


def add_status(s: argparse.ArgumentParser) -> None:
    s.add_argument("id", help="the job's id")
    s.add_argument("--json", action="store_true", help="print JSON (default: off)")


def add_result(s: argparse.ArgumentParser) -> None:
    s.add_argument("id", help="the job's id")
    s.add_argument(
        "--json",
        action="store_true",
        help="print text, token ids, finish reason and usage as JSON (default: off)",
    )
    _wait_arg(s, "the job's end")


def add_stream(s: argparse.ArgumentParser) -> None:
    s.add_argument("id", help="the job's id")
    _wait_arg(s, "the job's end")
    s.set_defaults(cancel_on_exit=False)


def add_jobs(s: argparse.ArgumentParser) -> None:
    s.add_argument("--queue", default=None, help="only this queue's jobs (default: every queue)")
    s.add_argument(
        "--status",
        choices=listing.STATUSES,
        default=None,
        help="only jobs in this state (default: any)",
    )
    s.add_argument("--limit", type=int, default=20, help="most jobs listed (default: %(default)s)")
    s.add_argument("--json", action="store_true", help="print JSON (default: off)")


def add_info(i: argparse.ArgumentParser) -> None:
    i.add_argument("--json", action="store_true", help="print JSON (default: off)")
    i.add_argument(
        "--watch", action="store_true", help="refresh in place until Ctrl-C (default: off)"
    )
    i.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="S",
        help="with --watch: seconds between refreshes (default: %(default)s)",
    )


# -- running them ----------------------------------------------------------------------


def _prompt(arg: str) -> str:
    if arg != "-":
        return arg
    text = sys.stdin.read()
    return text[:-1] if text.endswith("\n") else text


def run_submit(args: argparse.Namespace) -> int:
    prompt = _prompt(args.prompt)
    with Client(args.redis_url, queue=args.queue) as client:
        kw = {name: getattr(args, name) for name, _, _ in flags(GenerationRequest)}
        if args.chat:
            job = client.submit(messages=[{"role": "user", "content": prompt}], **kw)
        else:
            job = client.submit(prompt, **kw)
        if not args.stream:
            print(job.id)
            _warn_unserved(client, args.queue)
            return 0
        print(f"mlxq: job {job.id} queued on {args.queue!r}", file=sys.stderr, flush=True)
        _warn_unserved(client, args.queue)
        return _follow(client, job, args)


def _warn_unserved(client: Client, queue: str) -> None:
    """Say once, on stderr, that no live worker serves ``queue`` (the job waits for one),
    as run-batch does; the command goes on."""
    try:
        unserved = not listing.served(client.redis, queue)
    except redis.ResponseError:  # a rogue key where the queue's roll is: nothing to say
        return
    if unserved:
        print(
            f"mlxq: warning: no live worker serves queue {queue!r}: the job waits until one "
            f"does (start one: mlxq worker --model MODEL --queue {queue})",
            file=sys.stderr,
            flush=True,
        )


def _waiting_on(client: Client, job_id: str) -> str:
    """What a job that has not ended is waiting for, in words (for a --wait that passed)."""
    d = listing.job_details(client.redis, job_id)
    if d is None:
        return "the job is gone (its records expired or were purged)"
    queue = d["queue"] or "?"
    if d["status"] == "started":
        return f"it is running on worker {d['worker'] or '?'}"
    if d["status"] != "queued":
        return f"it is {d['status']}"
    with contextlib.suppress(redis.ResponseError):  # a rogue roll key: say no more
        if not listing.served(client.redis, queue):
            return f"it is still queued: no live worker serves queue {queue!r}"
    return f"it is still queued on {queue!r}, behind other jobs, for a free row"


def run_stream(args: argparse.Namespace) -> int:
    with Client(args.redis_url) as client:
        job = client.job(args.id)
        queue = listing.job_queue(client.redis, job.id)
        if job.status() == "queued" and queue is not None:
            _warn_unserved(client, queue)
        return _follow(client, job, args)


def _follow(client: Client, job: Job, args: argparse.Namespace) -> int:
    """Print the job's stream; on Ctrl-C or ``--wait`` passing, say that the job goes on
    (or cancel it, with ``--cancel-on-exit``)."""
    printer = StreamPrinter(job.id, sys.stdout)
    try:
        for chunk in job.stream(timeout=args.wait):
            printer.write(chunk)
            if chunk.final:
                print(
                    f"[{job.id} finish_reason={chunk.finish_reason} usage={chunk.usage}]",
                    file=sys.stderr,
                )
        return 0
    except KeyboardInterrupt:
        _left(job, args.cancel_on_exit, "interrupted")
        return 130
    except JobTimeout:
        why = _waiting_on(client, job.id)
        _left(job, args.cancel_on_exit, f"no end within --wait {args.wait:g} s ({why})")
        return 1


def _left(job: Job, cancel: bool, why: str) -> None:
    sys.stdout.write("\n")
    sys.stdout.flush()
    if cancel:
        verdict = "canceled" if job.cancel() else "had already ended"
        print(f"mlxq: {why}; job {job.id} {verdict}", file=sys.stderr)
    else:
        print(
            f"mlxq: {why}; job {job.id} goes on (follow it: mlxq stream {job.id}; "
            f"stop it: mlxq cancel {job.id})",
            file=sys.stderr,
        )


def _when(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    at = datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"{at} ({_secs(now - ts)} ago)"


def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.3f} s" if s < 60 else duration(s)


def run_status(args: argparse.Namespace) -> int:
    with Client(args.redis_url) as client:
        d = listing.job_details(client.redis, args.id)
    if d is None:
        raise NoSuchJob(f"no job {args.id!r} (never submitted, or its records expired)")
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    now = time.time()
    rows = [
        ("job", d["id"]),
        ("status", d["status"]),
        ("queue", d["queue"] or "-"),
        ("attempts", str(d["attempts"])),
        ("worker", d["worker"] or "-"),
        ("enqueued", _when(d["enqueued_at"], now)),
        ("started", _when(d["started_at"], now)),
        ("ended", _when(d["ended_at"], now)),
        ("queue wait", _secs(d["queue_wait_s"])),
        ("run time", _secs(d["run_s"])),
    ]
    if d["failure_reason"]:
        rows.append(("reason", d["failure_reason"]))
    for k, v in rows:
        print(f"{k:<11} {v}")
    return 0


def run_result(args: argparse.Namespace) -> int:
    with Client(args.redis_url) as client:
        try:
            res = client.job(args.id).result(timeout=args.wait)
        except JobTimeout as e:
            raise JobTimeout(f"{e} ({_waiting_on(client, args.id)})") from None
    if args.json:
        doc = {
            "id": args.id,
            "text": res.text,
            "token_ids": res.token_ids,
            "finish_reason": res.finish_reason,
            "usage": res.usage,
        }
        print(json.dumps(doc, ensure_ascii=False))
    else:
        print(res.text)
    return 0


def run_jobs(args: argparse.Namespace) -> int:
    with Client(args.redis_url) as client:
        jobs = listing.recent_jobs(client.redis, args.queue, args.status, args.limit)
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    table = Table(box=None, pad_edge=False)
    for col in ("id", "queue", "status", "age", "ran"):
        table.add_column(col, justify="right" if col in ("age", "ran") else "left", no_wrap=True)
    # The reason alone wraps (within its column) when a terminal is too narrow for it.
    table.add_column("reason", ratio=1, overflow="fold")
    for j in jobs:
        reason = for_terminal(j["failure_reason"], 0) if j["failure_reason"] else ""
        table.add_row(
            j["id"],
            j["queue"],
            j["status"],
            _secs(j["age_s"]),
            _secs(j["duration_s"]),
            Text(reason),
        )
    # A pipe or file gets whole lines, however long, for scripts (grep, awk) to read.
    width = None if sys.stdout.isatty() else 1 << 16
    Console(soft_wrap=True, width=width).print(table)
    if not jobs:
        print("no jobs", file=sys.stderr)
    return 0


def run_info(args: argparse.Namespace) -> int:
    conn = connect(args.redis_url)
    # Rate-limited: --watch meets the same bad key at every refresh.
    warn = Throttle(lambda msg: print(f"mlxq: warning: {msg}", file=sys.stderr))
    if not args.watch:
        doc = collect(conn, warn)
        warn.flush()
        if args.json:
            print(json.dumps(doc, indent=2))
        else:
            Console().print(render(doc))
        return 0
    if args.interval <= 0:
        raise ValueError(f"--interval={args.interval!r}: must be > 0")
    try:
        if args.json:  # one document per line, for scripts
            while True:
                print(json.dumps(collect(conn, warn)), flush=True)
                time.sleep(args.interval)
        with Live(render(collect(conn, warn), fit_height=True), auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(collect(conn, warn), fit_height=True), refresh=True)
    except KeyboardInterrupt:
        return 0
