"""``mlxq worker`` and ``mlxq model``: their arguments and defaults live here, with the
package that runs them; the ``mlxq`` entry point only dispatches. Importing this module
needs no MLX, so ``--help`` works anywhere and shows the real defaults."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from mlxq.producer import keys
from mlxq.producer.params import MAX_TOKENS_CAP
from mlxq.worker import config as c

WORKER_INSTALL_HINT = (
    "the worker needs MLX and mlx-lm: pip install 'mlxq[worker]' "
    "(on NVIDIA GPUs: pip install 'mlxq[cuda]')"
)
#: Modules whose absence means the worker extra is not installed (anything else missing
#: is a real bug and is reported as one).
WORKER_MODULES = ("mlx", "mlx_lm", "tokenizers")

WORKER_DESCRIPTION = """\
Serve one queue with one MLX model: claim jobs from Redis, decode them in continuous
batches (one vectorized sampling call per step, whatever the mix of params), and stream
every job's tokens back through Redis. Run one per machine; more machines scale out.
"""


def missing_worker_extra(e: ImportError) -> bool:
    name = e.name or ""
    return name.split(".")[0] in WORKER_MODULES


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="mlx-lm model path or Hugging Face repo id")
    p.add_argument(
        "--redis-url",
        default=os.environ.get("MLXQ_REDIS_URL", keys.DEFAULT_REDIS_URL),
        help="Redis URL (default: $MLXQ_REDIS_URL or %(default)s); prefer the "
        "environment variable for URLs with a password",
    )
    p.add_argument("--queue", default="default", help="queue to serve (default: %(default)s)")
    p.add_argument(
        "--window-ms",
        type=float,
        default=c.DEFAULT_WINDOW_MS,
        help="after a first job reaches an idle worker, wait this long for others "
        "to share its prefill (default: %(default)s)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=c.DEFAULT_MAX_BATCH,
        help="most jobs decoding at once (default: %(default)s; 64 pays on a GPU)",
    )
    p.add_argument(
        "--name",
        default=None,
        help="worker name (default: host.pid.random; rq refuses reused names)",
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=c.DEFAULT_GRACE_S,
        help="on SIGTERM/SIGINT, seconds running jobs may finish before they are "
        "requeued; a second signal stops at once (default: %(default)s)",
    )
    p.add_argument(
        "--stream-ttl",
        type=int,
        default=keys.DEFAULT_STREAM_TTL,
        help="seconds a job's replay log lives after its last chunk (default: %(default)s)",
    )
    p.add_argument(
        "--stream-interval-ms",
        type=float,
        default=c.DEFAULT_STREAM_INTERVAL_MS,
        help="tokens a job makes within this interval go out as one chunk; its "
        "first token never waits; 0 sends every token (default: %(default)s)",
    )
    p.add_argument(
        "--max-tokens-cap",
        type=int,
        default=MAX_TOKENS_CAP,
        help="largest max_tokens a job may ask for (default: %(default)s)",
    )
    p.add_argument(
        "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: %(default)s)"
    )


def config_from(args: argparse.Namespace) -> c.WorkerConfig:
    return c.WorkerConfig(
        model=args.model,
        redis_url=args.redis_url,
        queue=args.queue,
        window_ms=args.window_ms,
        max_batch=args.max_batch,
        name=args.name,
        grace_s=args.grace_s,
        stream_ttl=args.stream_ttl,
        stream_interval_ms=args.stream_interval_ms,
        max_tokens_cap=args.max_tokens_cap,
    )


def run_worker(args: argparse.Namespace) -> int:
    config = config_from(args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        from mlxq.worker.loop import Worker
    except ImportError as e:
        if not missing_worker_extra(e):
            raise
        print(f"mlxq: {WORKER_INSTALL_HINT} ({e})", file=sys.stderr)
        return 2
    return Worker(config).run()


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    kinds = p.add_subparsers(dest="kind", required=True)
    tiny = kinds.add_parser(
        "tiny", help="write a tiny random-weight Llama model (HF layout), for tests and demos"
    )
    tiny.add_argument("dir", help="directory to write into (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="weights seed (default: %(default)s)")


def run_model(args: argparse.Namespace) -> int:
    try:
        from mlxq.worker.tiny import build_tiny_model
    except ImportError as e:
        if not missing_worker_extra(e):
            raise
        print(f"mlxq: {WORKER_INSTALL_HINT} ({e})", file=sys.stderr)
        return 2
    print(build_tiny_model(args.dir, seed=args.seed))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mlxq.worker``: the same as ``mlxq worker``."""
    p = argparse.ArgumentParser(prog="python -m mlxq.worker", description=WORKER_DESCRIPTION)
    add_worker_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_worker(args)
    except ValueError as e:
        print(f"mlxq: {e}", file=sys.stderr)
        return 2
