"""``mlxq serve``'s settings, checked once."""

from __future__ import annotations

from dataclasses import dataclass

from mlxq.producer.client import DEFAULT_REDIS_URL

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
#: How often the gateway reads the workers' counters (the dashboard's tok/s samples).
DEFAULT_SAMPLE_S = 2.0
#: How long the tok/s chart reaches back.
DEFAULT_HISTORY_S = 600.0


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

    def __post_init__(self) -> None:
        if not isinstance(self.redis_url, str) or not self.redis_url:
            raise ValueError(f"redis_url={self.redis_url!r}: must be a redis:// URL")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise ValueError(f"port={self.port!r}: must be an integer")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port!r}: must be in [0, 65535]")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key: must be a non-empty string when set")
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
