"""The ``mlxq`` command: one entry that dispatches to the package that owns each command.

``model`` and ``worker`` live in :mod:`mlxq.worker.cli`, ``serve`` in the gateway,
``run-batch`` in :mod:`mlxq.producer.batch`, job control in :mod:`mlxq.producer.commands`,
``info`` here. Whatever goes wrong ends as one
line on stderr and a non-zero exit (2 for a bad value, 1 otherwise); ``--log-level
DEBUG`` adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import redis

from mlxq.producer import commands, keys
from mlxq.producer.batch import cli as batch_cli
from mlxq.producer.connection import connect, problem
from mlxq.producer.errors import MlxqError
from mlxq.producer.gateway import cli as gateway_cli
from mlxq.worker import cli as worker_cli

DESCRIPTION = "A Redis job queue for LLM generation on MLX."


def redis_url(arg: str | None) -> str:
    """The Redis URL a command uses: its ``--redis-url``, else ``$MLXQ_REDIS_URL``, else the
    default. Resolved here, not as argparse's default, so ``--help`` never shows a
    password."""
    return arg or os.environ.get("MLXQ_REDIS_URL") or keys.DEFAULT_REDIS_URL


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mlxq", description=DESCRIPTION)
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="build models")
    worker_cli.add_model_arguments(model)
    model.set_defaults(run=worker_cli.run_model)
    worker = sub.add_parser(
        "worker", help="run the MLX worker", description=worker_cli.WORKER_DESCRIPTION
    )
    worker_cli.add_worker_arguments(worker)
    worker.set_defaults(run=worker_cli.run_worker)

    parents = [_common()]
    commands.add_submit(sub, parents)
    for add in (
        commands.add_status,
        commands.add_result,
        commands.add_stream,
        commands.add_cancel,
        commands.add_jobs,
    ):
        add(sub, parents)

    batch = sub.add_parser("run-batch", help=batch_cli.HELP, description=batch_cli.DESCRIPTION)
    batch_cli.add_arguments(batch)
    batch.set_defaults(run=batch_cli.run)

    i = sub.add_parser("info", parents=parents, help="queues and workers")
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
    i.set_defaults(run=run_info)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API and the dashboard")
    gateway_cli.add_arguments(serve)
    serve.set_defaults(run=gateway_cli.run)
    return ap


def run_info(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from mlxq.producer.info import collect, render

    conn = connect(args.redis_url)

    def warn(msg: str) -> None:
        print(f"mlxq: warning: {msg}", file=sys.stderr)

    if not args.watch:
        doc = collect(conn, warn)
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
        with Live(render(collect(conn, warn)), auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(collect(conn, warn)), refresh=True)
    except KeyboardInterrupt:
        return 0


def _say(message: str, error: BaseException, debug: bool) -> None:
    if debug:
        traceback.print_exception(error)
    print(f"mlxq: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    level = str(getattr(args, "log_level", "WARNING")).upper()
    debug = level == "DEBUG"
    if hasattr(args, "redis_url"):
        args.redis_url = redis_url(args.redis_url)
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
