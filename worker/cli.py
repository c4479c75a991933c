"""``mlxq worker`` and ``mlxq model``: their arguments and defaults live here, with the
package that runs them; the ``mlxq`` entry point only dispatches. Importing this module
needs no MLX, so ``--help`` works anywhere and shows the real defaults."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from mlxq.producer import keys
from mlxq.producer.errors import SetupError
from mlxq.producer.heap import freeze_startup_heap, watch_collections
from mlxq.producer.params import MAX_TOKENS_CAP
from mlxq.worker import config as c
from mlxq.worker import logs, startup
from mlxq.worker.env import EnvOptions
from mlxq.worker.mlx_settings import apply_defaults, log_given

log = logging.getLogger("mlxq.worker")

#: An ``auto | on | off`` option's value as the config takes it (None: the worker decides).
SWITCH = {"auto": None, "on": True, "off": False}

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


def _bytes_or_auto(text: str) -> int | None:
    """``auto`` (None: sized from the device where MLX is loaded) or bytes >= 0."""
    if text.strip().lower() == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give bytes (an integer) or auto") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give bytes >= 0 (0 turns it off) or auto")
    return n


def _steps_or_auto(text: str) -> int | None:
    """``auto`` (None: decided where MLX is loaded) or a whole number of decode steps."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give decode steps (an integer) or auto"
        ) from None


def add_worker(p: argparse.ArgumentParser) -> None:
    """``mlxq worker``'s description and arguments."""
    p.description = WORKER_DESCRIPTION
    add_worker_arguments(p)


#: ``mlxq worker``'s options that read the environment: every one of them.
ENV = EnvOptions()


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """``mlxq worker``'s options, in the order ``--help`` lists them; each also reads an
    ``MLXQ_*`` environment variable (:mod:`mlxq.worker.env`), the command line winning."""
    p.epilog = (
        "Every option can come from the environment instead: --max-batch from "
        "MLXQ_MAX_BATCH and so on (named in each option's default), so a service needs "
        "only MLXQ_MODEL and MLXQ_REDIS_URL in its environment file."
    )
    _add_queue_arguments(p)
    _add_batch_arguments(p)
    _add_job_arguments(p)
    _add_service_arguments(p)


def _add_queue_arguments(p: argparse.ArgumentParser) -> None:
    """What to serve: the model, the Redis and the queue."""
    ENV.add(p, "--model", required=True, help="mlx-lm model path or Hugging Face repo id")
    # The environment's URL is read at run time, never shown: it may hold a password.
    ENV.add(
        p,
        "--redis-url",
        default=keys.DEFAULT_REDIS_URL,
        help="Redis URL; prefer the environment variable for a URL with a password, "
        "which ps would show",
    )
    ENV.add(
        p,
        "--queue",
        env="MLXQ_QUEUES",
        action="append",
        type=str.split,
        default=["default"],
        shown="default",
        help="queue to serve; give it again for more levels, the first the highest "
        "(--queue chat --queue default --queue sweeps); one value may name several "
        "queues of one level that split its rows by weight (--queue team-a:3,team-b:1); "
        "$MLXQ_QUEUES lists the levels split on spaces",
    )
    ENV.add_flag(
        p,
        "--allow-mixed-models",
        help="start even when live workers of its queues serve another model (by default "
        "it refuses: a job's answer would depend on which worker took it)",
    )
    ENV.add_switch(
        p,
        "--no-warm-up",
        dest="warm_up",
        help="claim jobs as soon as the model is loaded; by default a few rows of each "
        "common kind run through the batch first, so no job waits for MLX to build a "
        "kernel or an attention plan it meets for the first time",
    )
    ENV.add_switch(
        p,
        "--no-preempt",
        dest="preempt",
        help="never pause a running job for a higher level's; by default the youngest "
        "row of the lowest level running is paused (its KV kept) when no row is free",
    )
    ENV.add(
        p,
        "--reserve-rows",
        type=int,
        default=0,
        help="rows kept for the first level's jobs (those it holds count): lower levels "
        "use the rest",
    )
    ENV.add(
        p,
        "--max-pauses",
        type=int,
        default=c.DEFAULT_MAX_PAUSES,
        help="times one job may be paused, at most",
    )
    ENV.add(
        p,
        "--paused-kv-bytes",
        type=int,
        default=None,
        shown="the prompt cache's size",
        help="bytes of KV state kept for paused rows; past it a paused row's KV is "
        "dropped and prefilled again on resume",
    )


def _add_batch_arguments(p: argparse.ArgumentParser) -> None:
    """How the batch fills, and how the worker is named and stops."""
    ENV.add(
        p,
        "--window-ms",
        type=float,
        default=c.DEFAULT_WINDOW_MS,
        help="after a first job reaches an idle worker, wait this long for others "
        "to share its prefill",
    )
    ENV.add(
        p,
        "--window-max-ms",
        type=float,
        default=c.DEFAULT_WINDOW_MAX_MS,
        help="while jobs keep arriving (gaps under half of --window-ms), keep the "
        "window open up to this long, so a burst sent one request at a time shares one "
        "prefill",
    )
    ENV.add(
        p,
        "--max-batch",
        type=int,
        default=c.DEFAULT_MAX_BATCH,
        help="most jobs decoding at once (64 pays on a GPU)",
    )
    ENV.add(
        p,
        "--admit-hold-steps",
        type=_steps_or_auto,
        default=None,
        shown="auto",
        help="while the batch decodes, let jobs that arrive gather for up to this many "
        "decode steps, so they share one prefill (jobs sent one HTTP request at a time); "
        f"0 takes each in at once; auto: {c.CUDA_ADMIT_HOLD_STEPS} with MLX on CUDA, "
        f"else {c.DEFAULT_ADMIT_HOLD_STEPS}",
    )
    _add_switch(
        p,
        "--prefill-buckets",
        "pad each prefill to one of a few shapes, so a GPU reuses its attention "
        "plans instead of building one per new shape; auto: on with MLX on CUDA",
    )
    _add_switch(
        p,
        "--fused-prefill",
        "run a chat job's prompt that starts beside a busy batch in the batch's decode "
        "pass, not a pass of its own; auto: off (a sweep beside chat jobs ran slower with it)",
    )
    ENV.add(
        p,
        "--name",
        default=None,
        shown="host.pid.random",
        help="worker name (rq refuses reused names)",
    )
    ENV.add(
        p,
        "--grace-s",
        type=float,
        default=c.DEFAULT_GRACE_S,
        help="on SIGTERM/SIGINT, seconds running jobs may finish before they are "
        "requeued; a second signal stops at once",
    )
    ENV.add(
        p,
        "--slow-turn-ms",
        type=float,
        default=c.DEFAULT_SLOW_TURN_MS,
        help="log each decode turn this long or longer with where it went (every row "
        "waited for it); 0 logs none",
    )


def _add_switch(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    """An ``auto | on | off`` option (:data:`SWITCH`), ``auto`` by default."""
    ENV.add(p, flag, choices=tuple(SWITCH), default="auto", help=help)


def _add_job_arguments(p: argparse.ArgumentParser) -> None:
    """What a job may ask for and how its tokens go out."""
    ENV.add(
        p,
        "--stream-ttl",
        type=int,
        default=keys.DEFAULT_STREAM_TTL,
        help="seconds a job's replay log lives after its last chunk",
    )
    ENV.add(
        p,
        "--stream-interval-ms",
        type=float,
        default=c.DEFAULT_STREAM_INTERVAL_MS,
        help="tokens a job makes within this interval go out as one chunk; its "
        "first token never waits; 0 sends every token",
    )
    ENV.add(
        p,
        "--max-tokens-cap",
        type=int,
        default=MAX_TOKENS_CAP,
        help="largest max_tokens a job may ask for",
    )
    ENV.add(
        p,
        "--wait-replicas",
        type=int,
        default=0,
        help="a batch of ends counts as written (its jobs freed) once this many replicas "
        "confirm it (Redis WAIT); 0 does not wait",
    )


def _add_service_arguments(p: argparse.ArgumentParser) -> None:
    """Metrics, the prompt cache, chat routing and the log."""
    ENV.add(
        p,
        "--metrics-port",
        type=int,
        default=None,
        shown="off",
        help="serve Prometheus metrics at http://HOST:PORT/metrics",
    )
    ENV.add(
        p,
        "--metrics-host",
        default=c.DEFAULT_METRICS_HOST,
        help="address the metrics server binds",
    )
    ENV.add(
        p,
        "--prompt-cache-bytes",
        type=_bytes_or_auto,
        default=c.DEFAULT_PROMPT_CACHE_BYTES,
        shown="auto",
        metavar="BYTES",
        help="bytes of KV state kept so later jobs that start with the same tokens (a "
        "sweep's shared prefix, a chat's history) skip that part of the prefill: auto (a "
        "quarter of the GPU memory the model leaves, 1 GiB on a CPU) or bytes; 0 turns it off",
    )
    ENV.add_switch(
        p,
        "--no-routing",
        dest="routing",
        help="claim chat turns like any job; by default a claimed chat turn whose history "
        "another live worker with free rows holds in its prompt cache is handed to it",
    )
    ENV.add(
        p,
        "--log-level",
        default="INFO",
        help="DEBUG (adds tracebacks to errors), INFO, WARNING or ERROR",
    )
    ENV.add(
        p,
        "--log-format",
        choices=logs.FORMATS,
        default="text",
        help="text for people, json (one object per line) for log shippers",
    )


def config_from(args: argparse.Namespace) -> c.WorkerConfig:
    """The worker's settings: the command line's, else the environment's, else the
    defaults (``args`` is filled in place, see :meth:`EnvOptions.resolve`).

    Raises:
        ValueError: naming the option or variable and the bad value.
    """
    ENV.resolve(args)
    return c.WorkerConfig(
        model=args.model,
        redis_url=args.redis_url,
        queues=tuple(args.queue or ("default",)),
        preempt=args.preempt,
        warm_up=args.warm_up,
        reserve_rows=args.reserve_rows,
        max_pauses=args.max_pauses,
        paused_kv_bytes=args.paused_kv_bytes,
        window_ms=args.window_ms,
        window_max_ms=args.window_max_ms,
        max_batch=args.max_batch,
        name=args.name,
        grace_s=args.grace_s,
        slow_turn_ms=args.slow_turn_ms,
        stream_ttl=args.stream_ttl,
        stream_interval_ms=args.stream_interval_ms,
        max_tokens_cap=args.max_tokens_cap,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        prompt_cache_bytes=args.prompt_cache_bytes,
        routing=args.routing,
        admit_hold_steps=args.admit_hold_steps,
        prefill_buckets=SWITCH[args.prefill_buckets],
        fused_prefill=SWITCH[args.fused_prefill],
        allow_mixed_models=args.allow_mixed_models,
        wait_replicas=args.wait_replicas,
    )


def run_worker(args: argparse.Namespace) -> int:
    """Check what the worker needs (MLX, the model path, Redis and what its user may do)
    with one clear line for what is missing, then load the model and serve.

    Raises:
        SetupError: Redis cannot be reached or its user lacks a command, key or channel
            the worker uses; or the model cannot be loaded.
    """
    config = config_from(args)
    logs.setup(args.log_level, args.log_format)
    mlx_given = apply_defaults()  # MLX reads them at its first evaluation on the GPU
    try:
        from mlxq.worker.engine import Engine
        from mlxq.worker.process import Worker
    except ImportError as e:
        if not missing_worker_extra(e):
            raise
        print(f"mlxq: {WORKER_INSTALL_HINT} ({e})", file=sys.stderr)
        return 2
    if (problem := startup.model_problem(config.model)) is not None:
        raise SetupError(problem)
    startup.check_redis(config)
    digest = startup.digest_of(config.model)  # None: a repo id mlx-lm downloads as it loads
    if digest is not None:
        startup.check_model(config, digest)  # before the load: a refusal costs no minutes
    try:
        engine: Any = Engine.for_worker(config)
    except Exception as e:
        raise SetupError(startup.load_problem(config.model, e)) from e
    if digest is None:
        digest = startup.digest_of(config.model) or ""
        if digest:
            startup.check_model(config, digest)
    log_given(mlx_given)
    worker = Worker(config, engine, model_digest=digest)
    freeze_startup_heap(f"worker {config.worker_name}")
    watch_collections(f"worker {config.worker_name}")
    return worker.run()


def main(argv: list[str] | None = None) -> int:
    """``python -m mlxq.worker``: the same as ``mlxq worker``."""
    p = argparse.ArgumentParser(prog="python -m mlxq.worker", description=WORKER_DESCRIPTION)
    add_worker_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_worker(args)
    except (ValueError, SetupError) as e:
        if args.log_level.upper() == "DEBUG":
            log.exception("mlxq worker could not start")
        print(f"mlxq: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
