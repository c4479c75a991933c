"""Priority levels, pure decisions: reading --queue, weighted shares, whom to pause."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxq.batching.levels import Levels, Running, Share, Shares, to_pause
from mlxq.producer.errors import PayloadError


def test_each_queue_option_is_a_level_and_commas_share_one():
    lv = Levels.parse(["chat", "team-a:3,team-b", "sweeps"])
    assert lv.levels == (
        (Share("chat"),),
        (Share("team-a", 3), Share("team-b", 1)),
        (Share("sweeps"),),
    )
    assert lv.queues == ("chat", "team-a", "team-b", "sweeps")
    assert [lv.level_of(q) for q in lv.queues] == [0, 1, 1, 2]


@pytest.mark.parametrize(
    "values, says",
    [
        ([], "name at least one queue"),
        (["a:0"], "weight '0' of 'a' must be a whole number >= 1"),
        (["a:x"], "weight 'x' of 'a' must be a whole number >= 1"),
        (["a:-2"], "weight '-2' of 'a' must be a whole number >= 1"),
        (["a,,b"], "each queue needs a name"),
        (["a b"], "each queue needs a name"),
        (["a", "b,a"], "queue 'a' is named twice"),
    ],
)
def test_bad_queue_options_are_refused_by_value(values, says):
    with pytest.raises(PayloadError, match="queue") as e:
        Levels.parse(values)
    assert says in str(e.value)


def test_a_higher_level_always_goes_first():
    shares = Shares(Levels.parse(["chat", "default", "sweeps"]))
    assert shares.pick(["sweeps", "default", "chat"]) == "chat"
    assert shares.pick(["sweeps", "default"]) == "default"
    assert shares.pick(["sweeps"]) == "sweeps"
    assert shares.pick([]) is None and shares.pick(["unknown"]) is None


@settings(max_examples=60, deadline=None)
@given(
    a=st.integers(1, 5),
    b=st.integers(1, 5),
    tokens_a=st.integers(1, 64),
    tokens_b=st.integers(1, 64),
)
def test_backlogged_queues_of_one_level_share_tokens_by_weight(a, b, tokens_a, tokens_b):
    shares = Shares(Levels.parse([f"x:{a},y:{b}"]))
    made = {"x": 0, "y": 0}
    size = {"x": tokens_a, "y": tokens_b}
    for _ in range(2000):  # every job decodes its queue's size, both always waiting
        q = shares.pick(["x", "y"])
        assert q is not None
        shares.charge(q, size[q])
        made[q] += size[q]
    want = a / (a + b)
    got = made["x"] / (made["x"] + made["y"])
    # One job's tokens is the most a pick can overshoot by.
    slack = max(tokens_a, tokens_b) / (made["x"] + made["y"]) * 2
    assert abs(got - want) <= slack + 0.01


def test_a_queue_back_from_idle_is_owed_no_backlog():
    shares = Shares(Levels.parse(["x,y"]))
    for _ in range(100):  # y has nothing waiting: x takes every row
        shares.charge(shares.pick(["x"]) or "", 10)
    picks = []
    for _ in range(10):
        q = shares.pick(["x", "y"])
        assert q is not None
        shares.charge(q, 10)
        picks.append(q)
    assert picks.count("y") == 5  # alternating, not ten rows in a row for y


def test_after_the_whole_level_idled_no_queue_carries_its_old_deficit():
    shares = Shares(Levels.parse(["x:3,y:1"]))
    for _ in range(40):  # both busy, then x runs dry first and y goes on alone
        q = shares.pick(["x", "y"])
        assert q is not None
        shares.charge(q, 64)
    for _ in range(30):
        shares.charge(shares.pick(["y"]) or "", 64)
    # Both idle; then x's jobs arrive a moment before y's.
    picks = [shares.pick(["x"])]
    shares.charge("x", 64)
    for _ in range(16):
        q = shares.pick(["x", "y"])
        assert q is not None
        shares.charge(q, 64)
        picks.append(q)
    assert picks.count("y") == 4  # 3:1 from the start, not x alone until it made up


def _running(job_id, level, step, pauses=0):
    return Running(job_id, level, step, pauses)


def test_waiting_jobs_pause_the_youngest_rows_of_the_lowest_level():
    running = [
        _running("sweep-old", 2, 1),
        _running("sweep-young", 2, 9),
        _running("default", 1, 5),
        _running("chat", 0, 3),
    ]
    assert to_pause({0: 1}, running, free=0, max_pauses=3) == ["sweep-young"]
    assert to_pause({0: 2}, running, free=0, max_pauses=3) == ["sweep-young", "sweep-old"]
    assert to_pause({0: 3}, running, free=0, max_pauses=3) == [
        "sweep-young",
        "sweep-old",
        "default",
    ]
    assert to_pause({0: 9}, running, free=0, max_pauses=3) == [
        "sweep-young",
        "sweep-old",
        "default",
    ]  # never a row of the waiting job's own level
    assert to_pause({0: 2}, running, free=1, max_pauses=3) == ["sweep-young"]
    assert to_pause({0: 2}, running, free=2, max_pauses=3) == []


def test_only_a_strictly_higher_level_pauses_and_nothing_churns():
    running = [_running("a", 1, 1), _running("b", 2, 2, pauses=3)]
    assert to_pause({1: 1}, running, free=0, max_pauses=3) == []  # same level: it waits
    assert to_pause({2: 1}, running, free=0, max_pauses=3) == []  # lower: it waits
    assert to_pause({0: 2}, running, free=0, max_pauses=3) == ["a"]  # b was paused enough
