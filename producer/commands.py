"""``mlxq submit | status | result | stream | cancel | jobs``: job control from the shell.

Each ``add_*`` function adds one command's arguments (every option's help shows its
default) and sets ``run`` to the function that carries it out. Errors are raised, not
printed: the ``mlxq`` entry turns them into one line and an exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from typing import Any

from rich.console import Console
from rich.table import Table

from mlxq.producer import listing
from mlxq.producer.client import Client, Job, cancel_job
from mlxq.producer.errors import JobTimeout, NoSuchJob
from mlxq.producer.info import duration
from mlxq.producer.terminal import StreamPrinter

Parents = list[argparse.ArgumentParser]


def _wait_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds to wait for {what}; the job goes on after (default: as long as it takes)",
    )


def add_submit(sub: Any, parents: Parents) -> None:
    s = sub.add_parser(
        "submit",
        parents=parents,
        help="submit one job; print its id or stream its text",
        description="Queue one generation job. Without --stream, print its id on stdout; "
        "with --stream, print the id on stderr, then the text as it is made.",
    )
    s.add_argument(
        "prompt", help="the prompt; '-' reads it from stdin (one trailing newline dropped)"
    )
    s.add_argument("--queue", default="default", help="queue to submit to (default: %(default)s)")
    s.add_argument(
        "--max-tokens", type=int, default=256, help="most tokens to generate (default: %(default)s)"
    )
    s.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)"
    )
    s.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus mass; 1 disables (default: %(default)s)"
    )
    s.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="keep the k likeliest; 0 disables (default: %(default)s)",
    )
    s.add_argument(
        "--min-p", type=float, default=0.0, help="relative floor; 0 disables (default: %(default)s)"
    )
    s.add_argument("--seed", type=int, default=None, help="per-job seed (default: none, unseeded)")
    s.add_argument(
        "--stop", action="append", default=[], help="stop string, repeatable (default: none)"
    )
    s.add_argument(
        "--chat", action="store_true", help="send the prompt as one user message (default: off)"
    )
    s.add_argument(
        "--stream", action="store_true", help="stream the text as it is made (default: off)"
    )
    s.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds the job may run once started; past it, it fails (default: no limit)",
    )
    s.add_argument(
        "--ttl",
        type=float,
        default=None,
        metavar="S",
        help="seconds the job may wait in the queue; past it, it fails (default: no limit)",
    )
    _wait_arg(s, "the streamed job's end")
    s.add_argument(
        "--cancel-on-exit",
        action="store_true",
        help="with --stream: cancel the job when this command stops before its end "
        "(Ctrl-C, --wait passed); without it the job goes on (default: off)",
    )
    s.set_defaults(run=run_submit)


def add_status(sub: Any, parents: Parents) -> None:
    s = sub.add_parser(
        "status",
        parents=parents,
        help="one job's status, queue, attempts, worker, timings, failure reason",
    )
    s.add_argument("id", help="the job's id")
    s.add_argument("--json", action="store_true", help="print JSON (default: off)")
    s.set_defaults(run=run_status)


def add_result(sub: Any, parents: Parents) -> None:
    s = sub.add_parser("result", parents=parents, help="wait for one job's end and print its text")
    s.add_argument("id", help="the job's id")
    s.add_argument(
        "--json",
        action="store_true",
        help="print text, token ids, finish reason and usage as JSON (default: off)",
    )
    _wait_arg(s, "the job's end")
    s.set_defaults(run=run_result)


def add_stream(sub: Any, parents: Parents) -> None:
    s = sub.add_parser(
        "stream", parents=parents, help="print one job's text, live or replayed, until its end"
    )
    s.add_argument("id", help="the job's id")
    _wait_arg(s, "the job's end")
    s.set_defaults(run=run_stream, cancel_on_exit=False)


def add_cancel(sub: Any, parents: Parents) -> None:
    s = sub.add_parser("cancel", parents=parents, help="cancel jobs, queued or running")
    s.add_argument("ids", nargs="+", metavar="ID", help="the jobs' ids")
    s.set_defaults(run=run_cancel)


def add_jobs(sub: Any, parents: Parents) -> None:
    s = sub.add_parser("jobs", parents=parents, help="recent jobs with status and age")
    s.add_argument("--queue", default=None, help="only this queue's jobs (default: every queue)")
    s.add_argument(
        "--status",
        choices=listing.STATUSES,
        default=None,
        help="only jobs in this state (default: any)",
    )
    s.add_argument("--limit", type=int, default=20, help="most jobs listed (default: %(default)s)")
    s.add_argument("--json", action="store_true", help="print JSON (default: off)")
    s.set_defaults(run=run_jobs)


# -- running them ----------------------------------------------------------------------


def _prompt(arg: str) -> str:
    if arg != "-":
        return arg
    text = sys.stdin.read()
    return text[:-1] if text.endswith("\n") else text


def run_submit(args: argparse.Namespace) -> int:
    prompt = _prompt(args.prompt)
    with Client(args.redis_url, queue=args.queue) as client:
        kw: dict[str, Any] = dict(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            stop=args.stop,
            timeout=args.timeout,
            ttl=args.ttl,
        )
        if args.chat:
            job = client.submit(messages=[{"role": "user", "content": prompt}], **kw)
        else:
            job = client.submit(prompt, **kw)
        if not args.stream:
            print(job.id)
            return 0
        print(f"mlxq: job {job.id} queued on {args.queue!r}", file=sys.stderr, flush=True)
        return _follow(job, args)


def run_stream(args: argparse.Namespace) -> int:
    with Client(args.redis_url) as client:
        return _follow(client.job(args.id), args)


def _follow(job: Job, args: argparse.Namespace) -> int:
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
        _left(job, args.cancel_on_exit, f"no end within --wait {args.wait:g} s")
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
        res = client.job(args.id).result(timeout=args.wait)
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


def run_cancel(args: argparse.Namespace) -> int:
    said = {
        "canceled": "canceled",
        "requested": "cancel requested: it leaves its batch at the next step",
        "ended": "had already ended; nothing to cancel",
    }
    missing = 0
    with Client(args.redis_url) as client:
        for job_id in args.ids:
            verdict = cancel_job(client.redis, job_id)
            if verdict == "nosuch":
                missing += 1
                print(
                    f"mlxq: no job {job_id!r} (never submitted, or its records expired)",
                    file=sys.stderr,
                )
            else:
                print(f"{job_id} {said.get(verdict, verdict)}")
    return 1 if missing else 0


def run_jobs(args: argparse.Namespace) -> int:
    with Client(args.redis_url) as client:
        jobs = listing.recent_jobs(client.redis, args.queue, args.status, args.limit)
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    table = Table(box=None, pad_edge=False)
    for col in ("id", "queue", "status", "age", "ran"):
        table.add_column(col, justify="right" if col in ("age", "ran") else "left", no_wrap=True)
    for j in jobs:
        table.add_row(j["id"], j["queue"], j["status"], _secs(j["age_s"]), _secs(j["duration_s"]))
    Console(soft_wrap=True).print(table)
    if not jobs:
        print("no jobs", file=sys.stderr)
    return 0
