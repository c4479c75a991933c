"""The ``mlxq`` command: model, worker, submit, run-batch, info, serve."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from mlxq.producer.batch import cli as batch_cli
from mlxq.producer.client import DEFAULT_REDIS_URL, Client
from mlxq.producer.errors import JobFailed, MlxqError
from mlxq.producer.gateway import cli as gateway_cli
from mlxq.worker import cli as worker_cli


def _redis_url_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-url",
        default=os.environ.get("MLXQ_REDIS_URL", DEFAULT_REDIS_URL),
        help="Redis URL (default: $MLXQ_REDIS_URL or %(default)s)",
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mlxq", description="A Redis job queue for LLM generation on MLX."
    )
    sub = ap.add_subparsers(dest="command", required=True)

    worker_cli.add_model_arguments(sub.add_parser("model", help="build models"))
    worker_cli.add_worker_arguments(
        sub.add_parser(
            "worker", help="run the MLX worker", description=worker_cli.WORKER_DESCRIPTION
        )
    )

    s = sub.add_parser("submit", help="submit one job; print its id or stream its text")
    s.add_argument("prompt")
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--chat", action="store_true", help="send the prompt as one user message")
    s.add_argument("--stream", action="store_true", help="stream the text as it is made")
    s.add_argument("--timeout", type=float, default=None)
    _redis_url_arg(s)
    s.add_argument("--queue", default="default")

    batch_cli.add_arguments(
        sub.add_parser("run-batch", help=batch_cli.HELP, description=batch_cli.DESCRIPTION)
    )

    i = sub.add_parser("info", help="queues and workers")
    i.add_argument("--json", action="store_true")
    _redis_url_arg(i)

    gateway_cli.add_arguments(
        sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API and the dashboard")
    )
    return ap


def _cmd_model(args: argparse.Namespace) -> int:
    return worker_cli.run_model(args)


def _cmd_worker(args: argparse.Namespace) -> int:
    return worker_cli.run_worker(args)


def _cmd_submit(args: argparse.Namespace) -> int:
    client = Client(args.redis_url, queue=args.queue)
    kw = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
    )
    if args.chat:
        job = client.submit(messages=[{"role": "user", "content": args.prompt}], **kw)
    else:
        job = client.submit(args.prompt, **kw)
    if not args.stream:
        print(job.id)
        return 0
    for chunk in job.stream(timeout=args.timeout):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.finish_reason:
            sys.stdout.write("\n")
            print(
                f"[{job.id} finish_reason={chunk.finish_reason} usage={chunk.usage}]",
                file=sys.stderr,
            )
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    import redis

    from mlxq.producer.info import collect, render

    doc = collect(redis.Redis.from_url(args.redis_url))
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {
        "model": _cmd_model,
        "worker": _cmd_worker,
        "submit": _cmd_submit,
        "run-batch": batch_cli.run,
        "info": _cmd_info,
        "serve": gateway_cli.run,
    }[args.command]
    try:
        return handler(args)
    except JobFailed as e:
        print(f"mlxq: {e}", file=sys.stderr)
        return 1
    except (ValueError, MlxqError) as e:
        print(f"mlxq: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
