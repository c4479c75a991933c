"""A Redis managed by Sentinel: the one URL form that names it, and clients that follow its
master across a failover.

The form, for every mlxq component::

    redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]
        [?sentinel_password=...&sentinel_username=...]

The hosts are the sentinels (port 26379 when left out); ``user:password`` are the data
nodes' credentials; the sentinels' own, where they differ, go in the query. Clients come
from redis-py's ``Sentinel(...).master_for(service)``, which asks a sentinel for the master
on every new connection. On top of that, every connection error (a refused connect, a
demoted master's ``READONLY`` turned into "The previous master is now a slave") makes the
client drop its idle connections and forget the master it knew, so no retry goes back to the
old master over a kept connection (redis/redis-py#3560) and the asyncio pool asks Sentinel
again too (redis/redis-py#3874). This runs in the client's own retry policy
(:class:`Rediscover`), so a command with no retries left still resets the pool for the
caller's next attempt.
"""

from __future__ import annotations

import copy
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel as sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.retry import Retry

from mlxq.producer.errors import PayloadError

T = TypeVar("T")

SCHEME = "redis+sentinel"
#: The port a sentinel listens on when the URL gives none.
DEFAULT_PORT = 26379
#: The query parameters the form takes: the sentinels' own credentials.
QUERY = ("sentinel_username", "sentinel_password")


class RedisURLError(PayloadError):
    """A ``redis+sentinel://`` URL is malformed; the message names the bad part."""


def is_sentinel(url: str) -> bool:
    """Whether ``url`` names a Sentinel-managed Redis."""
    return url.lower().startswith(f"{SCHEME}://")


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL.

    Attributes:
        sentinels: ``(host, port)`` of each sentinel, in the URL's order.
        service: The master's name in the sentinels' ``sentinel monitor`` line.
        db: The database number on the data nodes.
        username, password: The data nodes' credentials (None: none).
        sentinel_username, sentinel_password: The sentinels' own (None: none).
    """

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)


def _bad(url: str, what: str) -> RedisURLError:
    return RedisURLError(
        f"Redis URL {redact(url)}: {what} (the form is {SCHEME}://[user:password@]"
        "host:port[,host:port...]/service_name[/db][?sentinel_password=...])"
    )


def _host_port(url: str, part: str) -> tuple[str, int]:
    if part.startswith("["):  # an IPv6 address: [::1]:26379
        host, _, rest = part[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
    else:
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
    if not host:
        raise _bad(url, f"sentinel {part!r} has no host")
    if not port:
        return host, DEFAULT_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise _bad(url, f"sentinel {part!r} has a bad port {port!r}")
    return host, int(port)


def _path(url: str, path: str) -> tuple[str, int]:
    parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")] if path else []
    if not parts or not parts[0]:
        raise _bad(url, "the service name (the path's first part) is missing")
    if len(parts) > 2:
        raise _bad(url, f"the path {path!r} has more than service_name/db")
    db = parts[1] if len(parts) == 2 else "0"
    if not db.isdigit():
        raise _bad(url, f"the db {db!r} is not a number")
    return parts[0], int(db)


def _query(url: str, query: str) -> dict[str, str]:
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    for k, _ in pairs:
        if k not in QUERY:
            raise _bad(url, f"unknown query parameter {k!r} (known: {', '.join(QUERY)})")
    return dict(pairs)


def parse(url: str) -> SentinelURL:
    """Read a ``redis+sentinel://`` URL.

    Raises:
        RedisURLError: A part is missing or malformed; the message names it.
    """
    if not is_sentinel(url):
        raise _bad(url, f"the scheme is not {SCHEME}://")
    rest = url[len(SCHEME) + 3 :]
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    auth, _, hosts = netloc.rpartition("@")
    user, _, password = auth.partition(":")
    if not hosts:
        raise _bad(url, "no sentinel host:port is given")
    sentinels = tuple(_host_port(url, h) for h in hosts.split(","))
    service, db = _path(url, slash + path)
    q = _query(url, query)
    return SentinelURL(
        sentinels=sentinels,
        service=service,
        db=db,
        username=urllib.parse.unquote(user) or None,
        password=urllib.parse.unquote(password) if ":" in auth else None,
        sentinel_username=q.get("sentinel_username") or None,
        sentinel_password=q.get("sentinel_password") or None,
    )


def redact(url: str) -> str:
    """``url`` with its passwords (the data nodes' and the sentinels') shown as ``***``."""
    rest = url[len(SCHEME) + 3 :]
    rest, mark, query = rest.partition("?")
    auth, at, tail = rest.rpartition("@")
    if at and ":" in auth:
        auth = auth.partition(":")[0] + ":***"
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        query = "&".join(f"{k}={'***' if 'password' in k else v}" for k, v in pairs)
    return f"{url[: len(SCHEME) + 3]}{auth}{at}{tail}{mark}{query}"


class Rediscover(Retry):
    """redis-py's ``Retry`` that, on every connection error, makes the pool forget the
    master it knew before the failure handler runs: the next connection asks Sentinel."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.pool: sentinel.SentinelConnectionPool | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Rediscover:
        # Each connection takes a copy of its retry: the copies share the one pool.
        twin = copy.copy(self)
        twin._backoff = copy.deepcopy(self._backoff, memo)
        return twin

    def call_with_retry(  # type: ignore[override]
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        def failed(error: Exception, *count: int) -> Any:
            if self.pool is not None and isinstance(error, redis.ConnectionError):
                self.pool.proxy.reset()  # connections to the old master are dropped on release
                self.pool.disconnect(inuse_connections=False)
            return fail(error, *count)

        return super().call_with_retry(do, failed, is_retryable, with_failure_count)


class AsyncRediscover(AsyncRetry):
    """The asyncio twin of :class:`Rediscover`."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.pool: aiosentinel.SentinelConnectionPool | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> AsyncRediscover:
        # Each connection takes a copy of its retry: the copies share the one pool.
        twin = copy.copy(self)
        twin._backoff = copy.deepcopy(self._backoff, memo)
        return twin

    async def call_with_retry(  # type: ignore[override]
        self,
        do: Callable[[], Awaitable[T]],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        async def failed(error: Exception, *count: int) -> Any:
            if self.pool is not None and isinstance(error, redis.ConnectionError):
                self.pool.master_address = None
                await self.pool.disconnect(inuse_connections=False)
            return await fail(error, *count)

        return await super().call_with_retry(do, failed, is_retryable, with_failure_count)


#: How often a client asks the sentinels whether its master moved, at most; while none
#: answers, half as often each time, down to once a minute (a sentinel that drops packets
#: costs its socket timeout, and the master may be serving well all the same).
CHECK_S = 1.0
MAX_CHECK_S = 60.0


class Recheck:
    """When a pool asks the sentinels for its master next."""

    def __init__(self) -> None:
        self.every, self.next_at = CHECK_S, time.monotonic() + CHECK_S

    def due(self) -> bool:
        now = time.monotonic()
        if now < self.next_at:
            return False
        self.next_at = now + self.every  # one asker at a time, whatever it meets
        return True

    def answered(self) -> None:
        self.every = CHECK_S

    def unanswered(self) -> None:
        self.every = min(MAX_CHECK_S, self.every * 2)
        self.next_at = time.monotonic() + self.every


class BlockingSentinelPool(sentinel.SentinelConnectionPool, redis.BlockingConnectionPool):
    """Sentinel's pool that waits for a free connection instead of raising, as mlxq's
    plain pools do, and asks the sentinels for the master again once a second it is used.

    Why: redis-py asks only when it opens a connection, and a kept connection to a master
    the sentinels replaced while it stayed up (a stall, a partition) would take writes
    that are lost when it is made a replica. A new address drops the idle connections, and
    busy ones are dropped when released (redis-py's pool owns only the master's). A
    sentinel that does not answer leaves the master known as it was.
    """

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.recheck = Recheck()

    def get_connection(self, *args: Any, **kw: Any) -> Any:
        if self.recheck.due():
            try:
                self.get_master_address()
                self.recheck.answered()
            except redis.RedisError:  # none answered: the master known stays
                self.recheck.unanswered()
        return super().get_connection(*args, **kw)


class AsyncBlockingSentinelPool(
    aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool
):
    """The asyncio twin of :class:`BlockingSentinelPool`. redis-py's asyncio pool takes
    back a released connection whatever server it talks to, so one still open to another
    address than the master's is closed here before use (it reconnects to the master)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.recheck = Recheck()

    async def get_connection(self, *args: Any, **kw: Any) -> Any:
        if self.recheck.due():
            try:
                await self.get_master_address()
                self.recheck.answered()
            except redis.RedisError:
                self.recheck.unanswered()
        conn = await super().get_connection(*args, **kw)
        known = self.master_address
        if known is not None and conn.is_connected and (conn.host, conn.port) != known:
            await conn.disconnect()
        return conn


def _sentinel_kwargs(u: SentinelURL, kw: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in kw.items() if k.startswith("socket_") and k != "socket_timeout"}
    # A sentinel that does not answer is skipped for the next one: never wait long on it.
    out["socket_timeout"] = out["socket_connect_timeout"] = 2.0
    if u.sentinel_username:
        out["username"] = u.sentinel_username
    if u.sentinel_password:
        out["password"] = u.sentinel_password
    return out


def _master_for(url: str, sentinels: Any, pool_class: Any, retry: Any, kw: dict[str, Any]) -> Any:
    """A client for the master of ``url``'s service, from ``sentinels`` (redis-py's sync or
    asyncio Sentinel module), its pool of ``pool_class``, which ``retry`` makes forget the
    master on a connection error."""
    u = parse(url)
    s = sentinels.Sentinel(list(u.sentinels), sentinel_kwargs=_sentinel_kwargs(u, kw))
    client = s.master_for(
        u.service,
        connection_pool_class=pool_class,
        db=u.db,
        username=u.username,
        password=u.password,
        retry=retry,
        **kw,
    )
    retry.pool = client.connection_pool
    return client


def master(url: str, retry: Rediscover, **kw: Any) -> redis.Redis:
    """A client for the master of the Sentinel-managed Redis at ``url``."""
    client: redis.Redis = _master_for(url, sentinel, BlockingSentinelPool, retry, kw)
    return client


def master_async(url: str, retry: AsyncRediscover, **kw: Any) -> aioredis.Redis:
    """The asyncio twin of :func:`master`."""
    client: aioredis.Redis = _master_for(url, aiosentinel, AsyncBlockingSentinelPool, retry, kw)
    return client


def cluster_problem(client: redis.Redis) -> str | None:
    """The one line that refuses a Redis in cluster mode, or None when it is not one.

    rq's keys and mlxq's multi-key scripts span hash slots, so a cluster would answer
    CROSSSLOT to the first of them.
    """
    try:
        enabled = str(client.info("cluster").get("cluster_enabled", 0)) == "1"
    except redis.ResponseError:  # INFO refused (an ACL): the scripts would say it later
        return None
    if not enabled:
        return None
    return (
        "Redis Cluster is not supported (rq's keys and mlxq's multi-key scripts span hash "
        "slots): use one Redis, or a Sentinel-managed one (redis+sentinel://...), per queue "
        "group"
    )
