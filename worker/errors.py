"""The worker's own exceptions (the producer's are in :mod:`mlxq.producer.errors`)."""

from __future__ import annotations


class LeaseLost(Exception):
    """A write was refused: this worker's lease is not its own (frozen, or reaped)."""


class ReplicasBehind(Exception):
    """A flush of ends was written, but fewer replicas than ``--wait-replicas`` confirmed
    it in time: the writer sends the flush again (every script is idempotent) and waits
    again before the jobs count as ended."""

    def __init__(self, asked: int, reached: int) -> None:
        super().__init__(f"only {reached} of {asked} replicas confirmed the jobs' ends")
