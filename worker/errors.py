"""The worker's own exceptions (the producer's are in :mod:`mlxq.producer.errors`)."""

from __future__ import annotations


class LeaseLost(Exception):
    """A write was refused: this worker's lease is not its own (frozen, or reaped)."""
