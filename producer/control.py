"""``mlxq cancel | retry | purge``: ending, requeueing and deleting jobs from the shell.

As in :mod:`mlxq.producer.commands`, ``add_X`` adds command X's arguments and ``run_X``
carries it out; errors are raised for the ``mlxq`` entry to print as one line.
"""

from __future__ import annotations

import argparse
import sys

from mlxq.producer import admin, listing
from mlxq.producer.client import Client
from mlxq.producer.job import cancel_job


def add_cancel(s: argparse.ArgumentParser) -> None:
    s.add_argument("ids", nargs="+", metavar="ID", help="the jobs' ids")


def add_retry(s: argparse.ArgumentParser) -> None:
    s.description = (
        "Requeue jobs that failed or were canceled, each with its original request, at its "
        "queue's end: a new attempt, whose stream replaces the old one (a listener that "
        "showed the old text gets a reset, then the new text)."
    )
    s.add_argument("ids", nargs="*", metavar="ID", help="the jobs' ids")
    s.add_argument(
        "--failed",
        action="store_true",
        help="every failed job (of --queue, else of every queue) instead (default: off)",
    )
    s.add_argument(
        "--canceled",
        action="store_true",
        help="every canceled job (of --queue, else of every queue) instead (default: off)",
    )
    s.add_argument(
        "--queue",
        default=None,
        help="with --failed / --canceled: only this queue's jobs (default: every queue)",
    )


def add_purge(s: argparse.ArgumentParser) -> None:
    s.description = (
        "Delete a queue's jobs in the given states, with their results and streams (a "
        "running job is canceled, never purged; jobs a worker already holds stay). Asks "
        "first on a terminal; elsewhere needs --yes."
    )
    s.add_argument("--queue", required=True, help="the queue whose jobs go")
    s.add_argument(
        "--status",
        action="append",
        choices=admin.PURGEABLE,
        default=None,
        help="only jobs in this state; give it again for more "
        f"(default: all of {', '.join(admin.PURGEABLE)})",
    )
    s.add_argument(
        "--yes", action="store_true", help="purge without asking (default: ask on a terminal)"
    )


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


def run_retry(args: argparse.Namespace) -> int:
    states = [s for s in admin.RETRYABLE if getattr(args, s)]
    if args.ids and states:
        raise ValueError("give job ids or --failed / --canceled, not both")
    if not args.ids and not states:
        raise ValueError("give the ids of jobs to retry, or --failed / --canceled")
    if args.queue is not None and not states:
        raise ValueError(f"--queue={args.queue!r}: only with --failed / --canceled")
    with Client(args.redis_url) as client:
        if args.ids:
            return _retry_ids(client, args.ids)
        found = 0
        for queue in admin.queue_names(client.redis, args.queue):
            for state in states:
                ids = admin.listed(client.redis, queue, state)
                if ids:
                    found += len(ids)
                    n = admin.retry(client.redis, ids).count("requeued")
                    print(f"queue {queue!r}: {n} of {len(ids)} {state} jobs requeued")
    if not found:
        where = "any queue" if args.queue is None else f"queue {args.queue!r}"
        print(f"mlxq: no {' or '.join(states)} jobs in {where}", file=sys.stderr)
    return 0


def _retry_ids(client: Client, job_ids: list[str]) -> int:
    bad = 0
    for job_id, verdict in zip(job_ids, admin.retry(client.redis, job_ids), strict=True):
        if verdict == "requeued":
            print(f"{job_id} requeued on {listing.job_queue(client.redis, job_id)!r}")
            continue
        bad += 1
        if verdict == "nosuch":
            why = "no such job (never submitted, or its records expired)"
        elif verdict in admin.RETRY_ERRORS:
            why = admin.RETRY_ERRORS[verdict]
        else:
            why = f"it is {verdict}: only failed or canceled jobs are retried"
        print(f"mlxq: {job_id}: {why}", file=sys.stderr)
    return 1 if bad else 0


def run_purge(args: argparse.Namespace) -> int:
    states = list(dict.fromkeys(args.status or admin.PURGEABLE))
    with Client(args.redis_url, queue=args.queue) as client:
        found = {s: admin.listed(client.redis, args.queue, s) for s in states}
        total = sum(map(len, found.values()))
        what = ", ".join(f"{len(found[s])} {s}" for s in states)
        if not total:
            print(f"mlxq: queue {args.queue!r} holds no jobs to purge ({what})", file=sys.stderr)
            return 0
        if not args.yes and not _confirmed(f"purge {total} jobs of queue {args.queue!r} ({what})"):
            print("mlxq: nothing purged", file=sys.stderr)
            return 1
        done = {s: admin.purge(client.redis, args.queue, s, found[s]) for s in states}
    n = sum(done.values())
    moved = f"; {total - n} had moved on meanwhile" if n < total else ""
    print(
        f"purged {n} jobs of queue {args.queue!r} "
        f"({', '.join(f'{done[s]} {s}' for s in states)}){moved}"
    )
    return 0


def _confirmed(question: str) -> bool:
    """Ask on the terminal; refuse where nobody can answer (stdin no terminal).

    Raises:
        ValueError: stdin is not a terminal (give --yes).
    """
    if not sys.stdin.isatty():
        raise ValueError(f"{question}? stdin is not a terminal to answer on: add --yes")
    print(f"{question}? [y/N] ", end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")
