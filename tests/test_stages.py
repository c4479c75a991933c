"""The decode thread's time by stage: each stage's own time, nested stages apart."""

from __future__ import annotations

import pytest

from mlxq.worker import stages as stages_module
from mlxq.worker.stages import Stages


class Clock:
    """A clock that moves only when told (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(stages_module.time, "perf_counter", c)
    return c


def test_a_nested_stage_counts_for_itself_not_for_the_outer_one(clock):
    s = Stages()
    with s.on("outer"):
        clock.now += 0.020
        with s.on("inner"):
            clock.now += 0.030
        with s.on("inner"):
            with s.on("deepest"):
                clock.now += 0.005
            clock.now += 0.010
        clock.now += 0.001
    ms = s.snapshot()
    assert ms == {"deepest": 5.0, "inner": 40.0, "outer": 21.0}
    assert sum(ms.values()) == pytest.approx(66.0)  # the wall time, counted once


def test_a_stage_that_raises_is_still_counted_and_the_stack_unwinds(clock):
    s = Stages()
    with pytest.raises(ValueError), s.on("outer"), s.on("inner"):
        clock.now += 0.002
        raise ValueError("x")
    with s.on("after"):
        clock.now += 0.001
    assert s.snapshot() == {"after": 1.0, "inner": 2.0, "outer": 0.0}
