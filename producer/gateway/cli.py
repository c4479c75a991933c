"""``mlxq serve``'s arguments and entry; imports FastAPI and uvicorn only when it runs."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from mlxq.producer.cli import add_wait_replicas
from mlxq.producer.client import DEFAULT_REDIS_URL
from mlxq.producer.gateway.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ROUTED_TIERS,
    GatewayConfig,
    api_key_problem,
    parse_service_tiers,
)
from mlxq.producer.heap import freeze_startup_heap, watch_collections

SERVE_INSTALL_HINT = "mlxq serve needs FastAPI and uvicorn: pip install 'mlxq[serve]'"
#: Seconds open streams get on SIGTERM before they are cut (and their jobs canceled).
GRACEFUL_S = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``mlxq serve``'s options to ``p``."""
    p.add_argument(
        "--host", default=DEFAULT_HOST, help="address to listen on (default %(default)s)"
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default %(default)s)")
    p.add_argument(
        "--redis-url",
        default=None,
        help=f"Redis URL (default: $MLXQ_REDIS_URL, else {DEFAULT_REDIS_URL})",
    )
    add_wait_replicas(p)
    # The default is read from the environment but never shown: it is a secret.
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* and the dashboard's data "
        "(default: $MLXQ_API_KEY; unset: no key needed)",
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=None,
        help="answer 429 when a queue holds this many waiting jobs (default: no cap)",
    )
    p.add_argument(
        "--service-tier",
        action="append",
        default=[],
        metavar="TIER=QUEUE",
        help="run requests whose service_tier is TIER on QUEUE instead of the queue their "
        f"model names; repeatable, TIER one of {', '.join(ROUTED_TIERS)} (default: none, "
        "every request runs on its model's queue)",
    )
    p.add_argument("--log-level", default="info", help="(default %(default)s)")


def api_key(option: str | None) -> str | None:
    """The key ``--api-key`` gives, else ``$MLXQ_API_KEY``; None when neither is set.

    Raises:
        ValueError: naming where the key came from, when it is set but unusable (empty,
            whitespace at an end, a character no HTTP header carries): an empty
            ``$MLXQ_API_KEY`` is refused like ``--api-key ""``, never read as "no key".
    """
    where, key = "--api-key", option
    if key is None:
        where, key = "$MLXQ_API_KEY", os.environ.get("MLXQ_API_KEY")
    if key is not None and (problem := api_key_problem(key)):
        raise ValueError(f"{where} {problem}")
    return key


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM.

    Raises:
        ValueError: a bad option value (``mlxq`` prints it and exits 2).
    """
    try:
        import uvicorn

        from mlxq.producer.gateway.app import create_app
    except ImportError as e:
        print(f"mlxq: {SERVE_INSTALL_HINT} ({e})", file=sys.stderr)
        return 2
    config = GatewayConfig(
        redis_url=args.redis_url or os.environ.get("MLXQ_REDIS_URL") or DEFAULT_REDIS_URL,
        host=args.host,
        port=args.port,
        api_key=api_key(args.api_key),
        max_queued=args.max_queued,
        service_tiers=parse_service_tiers(args.service_tier),
    )
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(config)
    freeze_startup_heap("gateway")
    watch_collections("gateway")
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=GRACEFUL_S,
    )
    return 0
