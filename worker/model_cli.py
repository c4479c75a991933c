"""``mlxq model tiny DIR``: build a tiny random-weight model for tests and demos, around its
own tokenizer or a real model's. Importing this module needs no MLX (``--help`` works
anywhere); building does.
"""

from __future__ import annotations

import argparse
import sys

from mlxq.worker.cli import WORKER_INSTALL_HINT, missing_worker_extra


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    kinds = p.add_subparsers(dest="kind", required=True)
    tiny = kinds.add_parser(
        "tiny", help="write a tiny random-weight Llama model (HF layout), for tests and demos"
    )
    tiny.add_argument("dir", help="directory to write into (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="weights seed (default: %(default)s)")
    tiny.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a real model's tokenizer.json and tokenizer_config.json (and generation_config.json)"
        " to build the model around: random weights, that model's text handling"
        " (default: the tiny model's own tokenizer)",
    )
    tiny.add_argument(
        "--eos-ids",
        metavar="IDS",
        help="with --tokenizer: the model's end-of-sequence ids, comma-separated"
        " (default: its generation_config.json's, else its eos_token)",
    )


def run_model(args: argparse.Namespace) -> int:
    try:
        from mlxq.worker.tiny import build_tiny_model, build_tiny_model_with_tokenizer
    except ImportError as e:
        if not missing_worker_extra(e):
            raise
        print(f"mlxq: {WORKER_INSTALL_HINT} ({e})", file=sys.stderr)
        return 2
    if args.tokenizer is None:
        if args.eos_ids is not None:
            print("mlxq: --eos-ids goes with --tokenizer", file=sys.stderr)
            return 2
        print(build_tiny_model(args.dir, seed=args.seed))
        return 0
    try:
        eos = None if args.eos_ids is None else [int(x) for x in args.eos_ids.split(",")]
    except ValueError:
        print(f"mlxq: --eos-ids={args.eos_ids!r}: comma-separated token ids", file=sys.stderr)
        return 2
    try:
        out = build_tiny_model_with_tokenizer(args.dir, args.tokenizer, seed=args.seed, eos_ids=eos)
    except ValueError as e:
        print(f"mlxq: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
