"""``mlxq run-batch``: its arguments and defaults (owned here), and the command itself."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from mlxq.producer import keys
from mlxq.producer.batch.config import (
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_PROGRESS_EVERY_S,
    PROGRESS_MODES,
    BatchConfig,
)
from mlxq.producer.batch.progress import PREFIX
from mlxq.producer.batch.run import run_batch
from mlxq.producer.cli import add_wait_replicas

DESCRIPTION = """\
Run every line of an OpenAI Batch input file ({"custom_id", "method": "POST", "url":
"/v1/chat/completions" | "/v1/completions", "body"}) as an mlxq job on the queue named by
body.model (or --queue), and write one output line per custom_id in OpenAI's Batch output
shape, in the order results come. Lines that cannot run go to --errors with their line
number; the rest still run. Rerun the same command to resume: custom_ids already answered
are skipped, jobs submitted before a crash or Ctrl-C are collected, not submitted again.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # keeps its lines as written
    p.add_argument("--input", "-i", required=True, type=Path, help="the batch file (JSONL)")
    p.add_argument(
        "--output",
        "-o",
        required=True,
        type=Path,
        help="output file (JSONL); an existing one is resumed, its custom_ids skipped",
    )
    p.add_argument(
        "--errors",
        type=Path,
        default=None,
        help="file for lines that cannot run (default: the output file)",
    )
    p.add_argument(
        "--queue", default=None, help="run every line on this queue (default: body.model)"
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help=f"Redis URL (default: $MLXQ_REDIS_URL, else {keys.DEFAULT_REDIS_URL})",
    )
    add_wait_replicas(p)
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=DEFAULT_MAX_IN_FLIGHT,
        help="most jobs of this run in Redis at once (default: %(default)s)",
    )
    p.add_argument(
        "--max-line-bytes",
        type=int,
        default=DEFAULT_MAX_LINE_BYTES,
        metavar="N",
        help="longest input line read; a longer one is reported as an error line and read "
        "past, never held in memory (default: %(default)s, the gateway's body cap)",
    )
    p.add_argument(
        "--detach",
        action="store_true",
        help="on Ctrl-C leave the jobs in flight running, for a rerun to collect "
        "(default: cancel them)",
    )
    p.add_argument(
        "--progress",
        choices=PROGRESS_MODES,
        default="auto",
        help="a bar on a terminal, plain lines otherwise (default: %(default)s)",
    )
    p.add_argument(
        "--progress-every",
        type=float,
        default=DEFAULT_PROGRESS_EVERY_S,
        metavar="S",
        help="seconds between plain progress lines (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``mlxq run-batch``; 0 when complete, 130 when stopped, 1 when a file could not
    be written or the input ended short (rerun to resume).

    Raises:
        ValueError: a bad argument (naming it).
        BatchLocked: another run writes the same output.
    """
    cfg = BatchConfig(
        input=args.input,
        output=args.output,
        errors=args.errors,
        queue=args.queue,
        redis_url=args.redis_url or os.environ.get("MLXQ_REDIS_URL") or keys.DEFAULT_REDIS_URL,
        max_in_flight=args.max_in_flight,
        detach=args.detach,
        progress=args.progress,
        progress_every_s=args.progress_every,
        max_line_bytes=args.max_line_bytes,
    )
    logger = logging.getLogger("mlxq")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"{PREFIX}: %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
    try:
        return run_batch(cfg)
    except OSError as e:  # a file that cannot be opened or written before the sweep
        print(f"mlxq: {e.filename or 'a file'}: {e.strerror or e}", file=sys.stderr)
        return 1
