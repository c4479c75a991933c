"""The ``mlxq`` command: model, worker, submit, info."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from mlxq.producer.client import DEFAULT_REDIS_URL, Client
from mlxq.producer.errors import JobFailed, MlxqError

WORKER_INSTALL_HINT = (
    "the worker needs MLX and mlx-lm: pip install 'mlxq[worker]' "
    "(on NVIDIA GPUs: pip install 'mlxq[cuda]')"
)


def _redis_url_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=os.environ.get("MLXQ_REDIS_URL", DEFAULT_REDIS_URL),
                   help="Redis URL (default: $MLXQ_REDIS_URL or %(default)s)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mlxq", description="A Redis job queue for LLM generation "
                                 "on MLX.")
    sub = ap.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="build models").add_subparsers(dest="kind", required=True)
    tiny = model.add_parser("tiny", help="write a tiny random-weight Llama model (HF layout)")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)

    w = sub.add_parser("worker", help="run the MLX worker")
    w.add_argument("--model", required=True, help="mlx-lm model path or Hugging Face repo id")
    _redis_url_arg(w)
    w.add_argument("--queue", default="default")
    w.add_argument("--window-ms", type=float, default=None,
                   help="wait this long after a first job for others to share its prefill "
                   "(default 20)")
    w.add_argument("--max-batch", type=int, default=None,
                   help="most jobs decoding at once (default 32)")
    w.add_argument("--name", default=None, help="worker name (default host.pid.random)")
    w.add_argument("--grace-s", type=float, default=None,
                   help="on SIGTERM, seconds in-flight jobs may finish before requeue (default 30)")
    w.add_argument("--stream-ttl", type=int, default=None,
                   help="seconds a job's replay log lives after its last chunk (default 3600)")
    w.add_argument("--max-tokens-cap", type=int, default=None,
                   help="largest max_tokens a job may ask for (default 32768)")
    w.add_argument("--log-level", default="INFO")

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

    i = sub.add_parser("info", help="queues and workers")
    i.add_argument("--json", action="store_true")
    _redis_url_arg(i)
    return ap


def _cmd_model(args: argparse.Namespace) -> int:
    try:
        from mlxq.worker.tiny import build_tiny_model
    except ImportError as e:
        print(f"mlxq: {WORKER_INSTALL_HINT} ({e})", file=sys.stderr)
        return 2
    path = build_tiny_model(args.dir, seed=args.seed)
    print(path)
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    try:
        from mlxq.worker.worker import Worker, WorkerConfig
    except ImportError as e:
        print(f"mlxq: {WORKER_INSTALL_HINT} ({e})", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = {k: v for k, v in (("window_ms", args.window_ms), ("max_batch", args.max_batch),
                              ("grace_s", args.grace_s), ("stream_ttl", args.stream_ttl),
                              ("max_tokens_cap", args.max_tokens_cap)) if v is not None}
    config = WorkerConfig(model=args.model, redis_url=args.redis_url, queue=args.queue,
                          name=args.name, **opts)
    return Worker(config).run()


def _cmd_submit(args: argparse.Namespace) -> int:
    client = Client(args.redis_url, queue=args.queue)
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
              top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop)
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
            print(f"[{job.id} finish_reason={chunk.finish_reason} usage={chunk.usage}]",
                  file=sys.stderr)
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    import redis

    from mlxq.producer.info import collect, render

    doc = collect(redis.Redis.from_url(args.redis_url))
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"model": _cmd_model, "worker": _cmd_worker, "submit": _cmd_submit,
               "info": _cmd_info}[args.command]
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
