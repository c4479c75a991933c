"""The Sentinel-managed Redis the tests start: the class lives in ``ops/sentinel_redis.py``,
which ``make soak --sentinel`` and the benchmark start too."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))

from sentinel_redis import DOWN_AFTER_MS, SERVICE, NoSentinel, SentinelRedis

__all__ = ["DOWN_AFTER_MS", "SERVICE", "NoSentinel", "SentinelRedis"]
