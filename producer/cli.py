"""The ``mlxq`` command: one entry that dispatches to the module that owns each command.

``model`` and ``worker`` live in :mod:`mlxq.worker.cli`, ``serve`` in the gateway,
``run-batch`` in :mod:`mlxq.producer.batch`, job control and ``info`` in
:mod:`mlxq.producer.commands`. As mlx-lm's ``cli.py`` does, only the chosen command's
module is imported (:data:`COMMANDS` holds the lines ``mlxq --help`` lists), so ``mlxq
submit`` never loads the worker. Whatever goes wrong ends as one line on stderr and a
non-zero exit (2 for a bad value, 1 otherwise); ``--log-level DEBUG`` adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Collection, Sequence
from importlib import metadata
from typing import Any, NamedTuple

import redis

from mlxq.producer import connection, keys
from mlxq.producer.connection import problem
from mlxq.producer.errors import MlxqError

DESCRIPTION = "A Redis job queue for LLM generation on MLX."


class Command(NamedTuple):
    """One ``mlxq`` command: its line in ``mlxq --help``, the module that owns it, the
    functions there that add its arguments (given its parser) and run it (given the
    parsed arguments), and whether it takes the shared ``--redis-url`` / ``--log-level``."""

    help: str
    module: str
    add: str
    run: str
    common: bool = True


_JOBS = "mlxq.producer.commands"
_CONTROL = "mlxq.producer.control"
#: Every command, in the order ``mlxq --help`` lists them.
COMMANDS: dict[str, Command] = {
    "model": Command(
        "build models", "mlxq.worker.model_cli", "add_model_arguments", "run_model", False
    ),
    "worker": Command("run the MLX worker", "mlxq.worker.cli", "add_worker", "run_worker", False),
    "submit": Command(
        "submit one job; print its id or stream its text", _JOBS, "add_submit", "run_submit"
    ),
    "status": Command(
        "one job's status, queue, attempts, worker, timings, failure reason",
        _JOBS,
        "add_status",
        "run_status",
    ),
    "result": Command(
        "wait for one job's end and print its text", _JOBS, "add_result", "run_result"
    ),
    "stream": Command(
        "print one job's text, live or replayed, until its end", _JOBS, "add_stream", "run_stream"
    ),
    "cancel": Command("cancel jobs, queued or running", _CONTROL, "add_cancel", "run_cancel"),
    "retry": Command(
        "requeue failed or canceled jobs with their request, as a new attempt",
        _CONTROL,
        "add_retry",
        "run_retry",
    ),
    "purge": Command(
        "delete a queue's queued or ended jobs (asks first)", _CONTROL, "add_purge", "run_purge"
    ),
    "jobs": Command(
        "recent jobs with status, age and failure reason", _JOBS, "add_jobs", "run_jobs"
    ),
    "run-batch": Command(
        "run an OpenAI Batch file (JSON lines) through mlxq queues; resumable",
        "mlxq.producer.batch.cli",
        "add_arguments",
        "run",
        False,
    ),
    "info": Command("queues and workers", _JOBS, "add_info", "run_info"),
    "serve": Command(
        "serve the OpenAI-compatible HTTP API and the dashboard",
        "mlxq.producer.gateway.cli",
        "add_arguments",
        "run",
        False,
    ),
}


def redis_url(arg: str | None) -> str:
    """The Redis URL a command uses: its ``--redis-url``, else ``$MLXQ_REDIS_URL``, else the
    default. Resolved here, not as argparse's default, so ``--help`` never shows a
    password."""
    return connection.redis_url(arg)


def add_wait_replicas(p: argparse.ArgumentParser) -> None:
    """The ``--wait-replicas`` option of the commands that submit."""
    p.add_argument(
        "--wait-replicas",
        type=int,
        default=None,
        metavar="N",
        help="a submit returns only once N replicas confirm its jobs (Redis WAIT) "
        f"(default: ${connection.WAIT_REPLICAS_ENV}, else 0: do not wait)",
    )


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    add_wait_replicas(p)
    p.add_argument(
        "--redis-url",
        default=None,
        help=f"Redis URL (default: $MLXQ_REDIS_URL, else {keys.DEFAULT_REDIS_URL}); "
        "prefer the environment variable for a URL with a password",
    )
    p.add_argument(
        "--log-level",
        default="WARNING",
        help="DEBUG (adds tracebacks to errors), INFO, WARNING or ERROR (default: %(default)s)",
    )
    return p


def _version() -> str:
    try:
        return metadata.version("mlxq")
    except metadata.PackageNotFoundError:
        return "unknown"


def _parser(load: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``mlxq`` parser, with the commands in ``load`` filled in (None: all of them)."""
    ap = argparse.ArgumentParser(prog="mlxq", description=DESCRIPTION)
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, c in COMMANDS.items():
        p = sub.add_parser(name, help=c.help, parents=[_common()] if c.common else [])
        if load is None or name in load:
            module = importlib.import_module(c.module)
            getattr(module, c.add)(p)
            p.set_defaults(run=getattr(module, c.run))
    return ap


def _chosen(argv: Sequence[str]) -> set[str]:
    # The first word that is no option names the command: the entry's own options
    # (--help, --version) take no value.
    return {next((a for a in argv if not a.startswith("-")), "")}


def _say(message: str, error: BaseException, debug: bool) -> None:
    if debug:
        traceback.print_exception(error)
    print(f"mlxq: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(_chosen(argv)).parse_args(argv)
    level = str(getattr(args, "log_level", "WARNING")).upper()
    debug = level == "DEBUG"
    if hasattr(args, "redis_url"):
        args.redis_url = redis_url(args.redis_url)
    # The worker reads its own (its options resolve from the environment later).
    if args.command != "worker" and getattr(args, "wait_replicas", None) is not None:
        # Every client this command makes reads it, as it reads $MLXQ_REDIS_URL.
        try:
            n = connection.wait_replicas(args.wait_replicas)
        except ValueError as e:
            _say(str(e), e, debug)
            return 2
        os.environ[connection.WAIT_REPLICAS_ENV] = str(n)
    if args.command not in ("worker", "serve", "run-batch"):  # these set up their own logging
        logging.basicConfig(
            level=level if isinstance(logging.getLevelName(level), int) else "WARNING",
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    run: Any = args.run
    try:
        return int(run(args))
    except KeyboardInterrupt:
        return 130
    except redis.RedisError as e:
        _say(problem(args.redis_url, e), e, debug)
        return 1
    except ValueError as e:  # PayloadError included: a bad value given
        _say(str(e), e, debug)
        return 2
    except MlxqError as e:
        _say(str(e), e, debug)
        return 1


if __name__ == "__main__":
    sys.exit(main())
