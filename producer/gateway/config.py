"""``mlxq serve``'s settings, checked once, and the queue each request goes to."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from mlxq.producer.client import DEFAULT_REDIS_URL
from mlxq.producer.openai_api import DEFAULT_TIER

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
#: How often the gateway reads the workers' counters (the dashboard's tok/s samples).
DEFAULT_SAMPLE_S = 2.0
#: How long the tok/s chart reaches back.
DEFAULT_HISTORY_S = 600.0
#: The service tiers ``--service-tier`` may send to a queue of their own. ``auto`` and
#: ``default`` always run on the queue ``model`` names; ``fast`` is read as ``priority``.
ROUTED_TIERS = ("flex", "scale", "priority")
MAX_QUEUE_CHARS = 128


def _tier_problem(tier: str, queue: str) -> str | None:
    """What is wrong with sending ``tier`` to ``queue``, None if nothing."""
    if tier in ("auto", DEFAULT_TIER):
        return f"{tier!r} always runs on the queue the request's model names"
    if tier == "fast":
        return "'fast' is OpenAI's other name for 'priority': map priority"
    if tier not in ROUTED_TIERS:
        return f"unknown tier {tier!r}: must be one of {', '.join(ROUTED_TIERS)}"
    if not isinstance(queue, str) or not 0 < len(queue) <= MAX_QUEUE_CHARS:
        return f"the queue must be a name of 1 to {MAX_QUEUE_CHARS} characters"
    return None


def api_key_problem(key: str) -> str | None:
    """What keeps ``key`` from being sent as ``Authorization: Bearer <key>``, None if
    nothing: it must be visible ASCII (spaces inside allowed), since a header carries no
    other text reliably, and have no space at either end, since a header's value loses
    it. The key itself is never quoted: it is a secret."""
    if not key:
        return "is empty (leave it unset for a gateway open to all)"
    if key != key.strip():
        return "has whitespace at an end, which no HTTP header keeps"
    for i, c in enumerate(key):
        if not " " <= c <= "~":
            kind = "a non-ASCII character" if ord(c) > 127 else "a control character"
            return f"has {kind} at position {i}, which an HTTP header cannot carry"
    return None


def parse_service_tiers(options: Iterable[str]) -> dict[str, str]:
    """``--service-tier TIER=QUEUE`` options as ``{tier: queue}``.

    Args:
        options: The options' values, e.g. ``["priority=chat", "flex=sweeps"]``.

    Raises:
        ValueError: naming the option's value and what is wrong with it (no ``=``, a tier
            that cannot be routed, an empty queue, a tier given twice).
    """
    tiers: dict[str, str] = {}
    for value in options:
        name, eq, target = value.partition("=")
        tier, queue = name.strip(), target.strip()
        where = f"--service-tier {value!r}"
        if not eq:
            raise ValueError(f"{where}: must be TIER=QUEUE, e.g. priority=chat")
        if problem := _tier_problem(tier, queue):
            raise ValueError(f"{where}: {problem}")
        if tier in tiers:
            first = f"{tier}={tiers[tier]}"
            raise ValueError(f"{where}: the tier {tier!r} is given twice (first as {first})")
        tiers[tier] = queue
    return tiers


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """How one gateway process runs.

    Args:
        redis_url: The Redis that holds the queues.
        host: Address to listen on.
        port: TCP port to listen on (0: any free one).
        api_key: When set, ``/v1/*`` and the dashboard's data need
            ``Authorization: Bearer <api_key>``. None: open.
        max_queued: Answer 429 once a queue holds this many waiting jobs. None: no cap.
        sample_s: Seconds between reads of the workers' counters.
        history_s: Seconds of tok/s history the dashboard charts.
        service_tiers: Tier -> queue: a request whose ``service_tier`` is one of these
            runs on that queue instead of the one its ``model`` names. Tiers from
            :data:`ROUTED_TIERS`.

    Raises:
        ValueError: naming the field and the bad value.
    """

    redis_url: str = DEFAULT_REDIS_URL
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    max_queued: int | None = None
    sample_s: float = DEFAULT_SAMPLE_S
    history_s: float = DEFAULT_HISTORY_S
    service_tiers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.redis_url, str) or not self.redis_url:
            raise ValueError(f"redis_url={self.redis_url!r}: must be a redis:// URL")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise ValueError(f"port={self.port!r}: must be an integer")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port!r}: must be in [0, 65535]")
        self._check_api_key()
        if self.max_queued is not None and (
            isinstance(self.max_queued, bool)
            or not isinstance(self.max_queued, int)
            or self.max_queued < 1
        ):
            raise ValueError(f"max_queued={self.max_queued!r}: must be an integer >= 1")
        for name in ("sample_s", "history_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}={value!r}: must be a number > 0")
        if not isinstance(self.service_tiers, Mapping):
            raise ValueError(f"service_tiers={self.service_tiers!r}: must map tier -> queue")
        for tier, queue in self.service_tiers.items():
            if problem := _tier_problem(tier, queue):
                raise ValueError(f"service_tiers[{tier!r}]={queue!r}: {problem}")
        object.__setattr__(self, "service_tiers", dict(self.service_tiers))

    def _check_api_key(self) -> None:
        key = self.api_key
        if key is None:
            return
        if not isinstance(key, str):
            raise ValueError(f"api_key: must be a string, not {type(key).__name__}")
        if problem := api_key_problem(key):
            raise ValueError(f"api_key {problem}")

    def route(self, model: str, service_tier: str | None) -> tuple[str, str]:
        """The queue a request runs on and the tier it is served at (what it echoes).

        A tier of :attr:`service_tiers` runs on its queue; any other (``auto``,
        ``default``, none, a tier with no queue) on the queue ``model`` names, at
        ``default``, since that is how it is served.
        """
        queue = self.service_tiers.get(service_tier) if service_tier else None
        if queue is None or service_tier is None:
            return model, DEFAULT_TIER
        return queue, service_tier
