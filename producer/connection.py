"""Redis connections and the one backoff policy mlxq uses for them (redis-py's own).

Every client mlxq makes (producers, the worker's threads, listeners) comes from
:func:`connect`, and every loop that rides out a Redis outage retries with
:func:`retry_forever`: redis-py's ``Retry`` with ``ExponentialBackoff``, 50 ms doubling to
0.5 s. An outage is logged twice, when it starts and when it ends, not on every attempt.
"""

from __future__ import annotations

import logging
import os
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from mlxq.producer import keys, sentinel

T = TypeVar("T")

#: Where every mlxq command and client finds its Redis when given no URL: the environment,
#: so a URL with a password stays off command lines and out of code.
REDIS_URL_ENV = "MLXQ_REDIS_URL"


def redis_url(url: str | None = None) -> str:
    """The Redis URL to use: ``url`` when given, else ``$MLXQ_REDIS_URL``, else
    :data:`~mlxq.producer.keys.DEFAULT_REDIS_URL` (read at each call, so a client made
    after the variable is set uses it)."""
    return url or os.environ.get(REDIS_URL_ENV) or keys.DEFAULT_REDIS_URL


#: How many replicas must confirm a submit (and a worker's ends) before they count as
#: done, when a command or client is given no number: 0 (do not wait) when unset.
WAIT_REPLICAS_ENV = "MLXQ_WAIT_REPLICAS"
#: How long one ``WAIT`` for replicas may take by default; at most :data:`MAX_WAIT_S`.
WAIT_TIMEOUT_S = 2.0
#: The longest ``WAIT``: it blocks the connection, whose reads time out after 5 s
#: (redis-py's default socket timeout).
MAX_WAIT_S = 4.0


def wait_replicas(n: int | None = None) -> int:
    """The replicas to wait for: ``n`` when given, else ``$MLXQ_WAIT_REPLICAS``, else 0.

    Raises:
        ValueError: naming the value (or the variable) that is no count of replicas.
    """
    where = "wait_replicas"
    if n is None:
        where, raw = WAIT_REPLICAS_ENV, os.environ.get(WAIT_REPLICAS_ENV, "").strip() or "0"
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(f"{where}={raw!r}: give a number of replicas (0 or more)") from None
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 1000:
        raise ValueError(f"{where}={n!r}: give a number of replicas, 0 to 1000")
    return n


#: What counts as Redis being away (restarting, unreachable, out of memory): retried.
TRANSIENT: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.BusyLoadingError,
)


#: The longest pause between two attempts: short, so a worker is back within half a
#: second of a Sentinel's promotion (or a restart), at a few calls a second per thread.
BACKOFF_CAP_S = 0.5


def backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=BACKOFF_CAP_S, base=0.025)


#: Connections one client keeps at most; more concurrent calls wait for a free one
#: (redis-py's own pool would raise instead).
MAX_CONNECTIONS = 64
#: How long a call waits for a free connection before it fails.
POOL_TIMEOUT_S = 30.0


def connect(url: str, *, retries: int = 2, **kw: Any) -> redis.Redis:
    """A client for ``url`` whose single commands ride out a brief blip.

    Args:
        url: ``redis://[user:pass@]host:port/db``, ``rediss://`` for TLS, or
            ``redis+sentinel://[user:pass@]host:port[,host:port...]/service[/db]`` for a
            Redis managed by Sentinel (see :mod:`mlxq.producer.sentinel`).
        retries: Times redis-py retries a command on a dropped connection (the callers'
            own loops handle longer outages); 0 for calls that must not be repeated
            blindly.
        **kw: Passed to redis-py's connection pool (``socket_timeout`` and the like).
    """
    kw.setdefault("health_check_interval", 30)
    kw.setdefault("socket_keepalive", True)
    kw.setdefault("max_connections", MAX_CONNECTIONS)
    kw.setdefault("timeout", POOL_TIMEOUT_S)
    if sentinel.is_sentinel(url):
        return sentinel.master(url, sentinel.Rediscover(backoff(), retries), **kw)
    retry = Retry(backoff(), retries)
    pool = redis.BlockingConnectionPool.from_url(url, retry=retry, **kw)
    client = redis.Redis(connection_pool=pool, retry=retry)
    client.auto_close_connection_pool = True
    return client


def connect_async(url: str, *, retries: int = 2) -> aioredis.Redis:
    """The asyncio twin of :func:`connect`."""
    if sentinel.is_sentinel(url):
        return sentinel.master_async(
            url,
            sentinel.AsyncRediscover(backoff(), retries),
            health_check_interval=30,
            max_connections=MAX_CONNECTIONS,
            timeout=POOL_TIMEOUT_S,
        )
    retry = AsyncRetry(backoff(), retries)
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        retry=retry,
        health_check_interval=30,
        max_connections=MAX_CONNECTIONS,
        timeout=POOL_TIMEOUT_S,
    )
    client = aioredis.Redis(connection_pool=pool, retry=retry)
    client.auto_close_connection_pool = True
    return client


def redact(url: str) -> str:
    """``url`` with its password shown as ``***``: for messages and logs."""
    if sentinel.is_sentinel(url):
        return sentinel.redact(url)
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:
        return "<unparsable URL>"
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def problem(url: str, error: Exception) -> str:
    """The one line that says what went wrong talking to the Redis at ``url``, and what to
    do about it (the password never shown)."""
    where = redact(url)
    if isinstance(error, redis.AuthenticationError):
        return (
            f"Redis at {where} refused the credentials ({type(error).__name__}: {error}): "
            "check the URL's user and password"
        )
    if isinstance(error, TRANSIENT):
        return (
            f"cannot reach Redis at {where} ({error}): start redis-server there, or point "
            "--redis-url (or $MLXQ_REDIS_URL) at a running one"
        )
    return f"Redis at {where} answered with an error: {error}"


class Outage:
    """Logs the start and the end of one outage, whatever the number of attempts between."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self.log, self.what = log, what
        self.since: float | None = None

    def failed(self, error: Exception) -> None:
        if self.since is None:
            self.since = time.monotonic()
            self.log.warning("%s: redis unavailable (%s); retrying with backoff", self.what, error)

    def ok(self) -> None:
        if self.since is not None:
            self.log.warning(
                "%s: redis back after %.1f s", self.what, time.monotonic() - self.since
            )
            self.since = None


def retry_forever(
    do: Callable[[], T], outage: Outage, errors: tuple[type[Exception], ...] = TRANSIENT
) -> T:
    """Call ``do`` until it succeeds, backing off on ``errors``; other errors propagate
    (so a caller stops a retry by raising its own)."""
    result = Retry(backoff(), -1, supported_errors=errors).call_with_retry(do, outage.failed)
    outage.ok()
    return result
