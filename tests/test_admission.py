"""Admission and the prefill window: pure decisions, checked without Redis or a model."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxq.batching.admission import AdmissionPolicy, Pending, admit
from mlxq.batching.window import Window

GREEDY = (0.0, 1.0, 0, 0.0)
WARM = (0.7, 0.9, 0, 0.0)
HOT = (1.2, 1.0, 40, 0.05)
KEYS = (GREEDY, WARM, HOT, (0.3, 0.5, 5, 0.1))


def job(n, key, arrived=0):
    return Pending(job_id=f"j{n}", key=key, arrived_step=arrived)


def ids(jobs):
    return [p.job_id for p in jobs]


# -- unit tests -------------------------------------------------------------------------------


def test_nothing_pending_or_no_slot_admits_nothing():
    policy = AdmissionPolicy(max_batch=4)
    assert admit([], {}, 4, 0, policy) == []
    assert admit([job(0, GREEDY)], {}, 0, 0, policy) == []


def test_running_key_is_preferred_over_a_larger_group():
    pending = [job(0, WARM), job(1, WARM), job(2, WARM), job(3, HOT)]
    chosen = admit(pending, {HOT: 5}, 1, 0, AdmissionPolicy(max_batch=8))
    assert ids(chosen) == ["j3"]


def test_zero_count_in_running_means_not_running():
    pending = [job(0, WARM), job(1, WARM), job(2, HOT)]
    chosen = admit(pending, {HOT: 0}, 2, 0, AdmissionPolicy(max_batch=8))
    assert ids(chosen) == ["j0", "j1"]


def test_largest_group_first_then_fifo_inside_it():
    pending = [job(0, HOT), job(1, WARM), job(2, WARM), job(3, WARM), job(4, GREEDY)]
    chosen = admit(pending, {}, 2, 0, AdmissionPolicy(max_batch=8))
    assert ids(chosen) == ["j1", "j2"]


def test_equal_groups_go_to_the_key_that_waited_longest():
    pending = [job(0, HOT, 1), job(1, WARM, 0), job(2, HOT, 1), job(3, WARM, 2)]
    chosen = admit(pending, {}, 2, 2, AdmissionPolicy(max_batch=8))
    assert ids(chosen) == ["j1", "j3"]


def test_params_never_idle_a_slot():
    pending = [job(0, WARM), job(1, HOT)]
    chosen = admit(pending, {GREEDY: 7}, 3, 0, AdmissionPolicy(max_batch=8))
    assert sorted(ids(chosen)) == ["j0", "j1"]


def test_aged_jobs_go_first_oldest_first():
    policy = AdmissionPolicy(max_batch=8, max_wait_steps=4)
    pending = [job(0, WARM, 9), job(1, HOT, 3), job(2, HOT, 1), job(3, WARM, 9)]
    chosen = admit(pending, {WARM: 6}, 3, 10, policy)
    assert ids(chosen) == ["j2", "j1", "j0"]


def test_aged_admissions_count_as_running():
    policy = AdmissionPolicy(max_batch=8, max_wait_steps=4)
    pending = [job(0, HOT, 0), job(1, WARM, 5), job(2, WARM, 5), job(3, HOT, 5)]
    chosen = admit(pending, {}, 2, 5, policy)
    assert ids(chosen) == ["j0", "j3"]


def test_zero_wait_is_strict_fifo():
    policy = AdmissionPolicy(max_batch=8, max_wait_steps=0)
    pending = [job(0, HOT, 2), job(1, WARM, 0), job(2, WARM, 1)]
    assert ids(admit(pending, {WARM: 3}, 3, 2, policy)) == ["j1", "j2", "j0"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_batch": 0}, "max_batch=0"),
        ({"max_batch": True}, "max_batch=True"),
        ({"max_batch": 4, "max_wait_steps": -1}, "max_wait_steps=-1"),
        ({"max_batch": 4, "max_wait_steps": 1.5}, "max_wait_steps=1.5"),
    ],
)
def test_policy_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AdmissionPolicy(**kwargs)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (([], {}, -1, 0), "free_slots=-1"),
        (([], {}, 5, 0), "free_slots=5"),
        (([], {}, 1, -1), "step=-1"),
        (([], {WARM: -2}, 1, 0), "running"),
        (([job(0, WARM, 3)], {}, 1, 2), "arrived_step=3"),
    ],
)
def test_admit_names_the_bad_argument(args, field):
    with pytest.raises(ValueError, match=field):
        admit(*args, policy=AdmissionPolicy(max_batch=4))


# -- properties of one call -------------------------------------------------------------------

keys = st.sampled_from(KEYS)


@st.composite
def situations(draw):
    step = draw(st.integers(0, 60))
    n = draw(st.integers(0, 24))
    arrivals = sorted(draw(st.lists(st.integers(0, step), min_size=n, max_size=n)))
    pending = [job(i, draw(keys), a) for i, a in enumerate(arrivals)]
    running = draw(st.dictionaries(keys, st.integers(0, 8)))
    policy = AdmissionPolicy(
        max_batch=draw(st.integers(1, 16)), max_wait_steps=draw(st.integers(0, 40))
    )
    free = draw(st.integers(0, policy.max_batch))
    return pending, running, free, step, policy


@given(situations())
def test_admits_distinct_pending_jobs_and_fills_every_slot_it_can(case):
    pending, running, free, step, policy = case
    chosen = admit(pending, running, free, step, policy)
    assert all(any(p is q for q in pending) for p in chosen)
    assert len({p.job_id for p in chosen}) == len(chosen)
    assert len(chosen) == min(free, len(pending))


@given(situations())
def test_aged_jobs_come_first_and_oldest_first(case):
    pending, running, free, step, policy = case
    chosen = admit(pending, running, free, step, policy)
    is_aged = [step - p.arrived_step >= policy.max_wait_steps for p in chosen]
    assert is_aged == sorted(is_aged, reverse=True)
    aged = [p for p in pending if step - p.arrived_step >= policy.max_wait_steps]
    assert ids(chosen[: len(aged)]) == ids(aged[: len(chosen)])


@given(situations())
def test_running_keys_first_and_fifo_within_a_key_when_no_one_is_aged(case):
    pending, running, free, step, _ = case
    policy = AdmissionPolicy(max_batch=16, max_wait_steps=step + 1)
    chosen = admit(pending, running, free, step, policy)
    warm = [running.get(p.key, 0) > 0 for p in chosen]
    assert warm == sorted(warm, reverse=True)
    if any(running.get(p.key, 0) > 0 for p in pending if p not in chosen):
        assert all(warm)
    for key in KEYS:
        of_key = [p for p in pending if p.key == key]
        taken = [p for p in chosen if p.key == key]
        assert ids(taken) == ids(of_key[: len(taken)])


@given(situations())
def test_first_pick_is_a_largest_group_when_nothing_runs(case):
    pending, _, free, step, _ = case
    policy = AdmissionPolicy(max_batch=16, max_wait_steps=step + 1)
    chosen = admit(pending, {}, free, step, policy)
    if chosen:
        sizes = Counter(p.key for p in pending)
        assert sizes[chosen[0].key] == max(sizes.values())


@given(situations())
def test_deterministic_and_blind_to_running_order(case):
    pending, running, free, step, policy = case
    shuffled = dict(reversed(list(running.items())))
    first = admit(pending, running, free, step, policy)
    assert first == admit(list(pending), shuffled, free, step, policy)


# -- the wait bound, over a stream of steps ----------------------------------------------------

streams = st.lists(
    st.tuples(st.lists(keys, max_size=4), st.integers(1, 6)),  # (arrivals, free slots) a step
    min_size=1,
    max_size=80,
)


@settings(max_examples=150)
@given(streams, st.integers(0, 12))
def test_no_job_waits_past_the_bound_once_aged(stream, max_wait):
    """Module docstring's bound: after a job ages with A jobs ahead of it, the
    free slots of the steps that pass it over sum to at most A."""
    policy = AdmissionPolicy(max_batch=6, max_wait_steps=max_wait)
    pending: list[Pending] = []
    ahead: dict[str, int] = {}  # job id -> A, fixed when it ages
    passed_over: Counter[str] = Counter()  # free slots of steps that skipped it once aged
    skips: Counter[str] = Counter()  # steps that skipped it once aged
    recent: list[list[Pending]] = []  # the last few admissions stand in for the running batch
    n = 0
    for step, (arrivals, free) in enumerate(stream):
        for key in arrivals:
            pending.append(job(n, key, step))
            n += 1
        for i, p in enumerate(pending):
            if step - p.arrived_step == max_wait:
                ahead[p.job_id] = i
        running = Counter(p.key for batch in recent[-3:] for p in batch)
        chosen = admit(pending, running, free, step, policy)
        taken = {p.job_id for p in chosen}
        for p in pending:
            if p.job_id in ahead and p.job_id not in taken:
                passed_over[p.job_id] += free
                skips[p.job_id] += 1
        pending = [p for p in pending if p.job_id not in taken]
        recent.append(chosen)
    for job_id, a in ahead.items():
        assert passed_over[job_id] <= a
        # With at least one slot a step: admitted within A steps of ageing.
        assert skips[job_id] <= a


# -- the prefill window ------------------------------------------------------------------------


def test_window_closes_at_the_deadline_not_before():
    w = Window(window_s=0.02, max_batch=4)
    w.open(10.0)
    assert not w.should_close(10.019, 1)
    assert w.should_close(10.02, 1)
    assert w.remaining(11.0) == 0.0


def test_window_closes_early_when_a_batch_is_full():
    w = Window(window_s=0.02, max_batch=4)
    w.open(10.0)
    assert not w.should_close(10.0, 3)
    assert w.should_close(10.0, 4)


def test_a_fixed_window_is_not_extended_by_later_arrivals():
    w = Window(window_s=0.02, max_batch=4)
    w.open(10.0)
    w.open(10.015)
    w.arrived(10.019)
    assert w.opened_at == 10.0
    assert w.should_close(10.02, 1)


def test_a_burst_still_coming_in_keeps_the_window_open_up_to_its_longest():
    w = Window(window_s=0.02, max_batch=64, longest_s=0.06)
    w.open(10.0)
    assert w.should_close(10.02, 1)  # a lone job waits window_s, no longer
    for i in range(1, 30):  # one arrival a millisecond past the deadline
        w.arrived(10.0 + i / 1000)
    assert not w.should_close(10.035, 30)
    assert w.remaining(10.029) == pytest.approx(0.010)  # the quiet gap, half a window
    assert w.should_close(10.04, 30)
    w.close()
    w.open(20.0)  # a trickle that never pauses: closed at longest_s all the same
    for i in range(1, 100):
        w.arrived(20.0 + i / 1000)
    assert not w.should_close(20.059, 40) and w.should_close(20.06, 40)
    assert w.should_close(20.0, 64)  # a full batch closes it at once


def test_the_longest_window_is_never_shorter_than_the_window():
    assert Window(window_s=0.5, max_batch=4, longest_s=0.06).longest_s == 0.5
    assert Window(window_s=0, max_batch=4, longest_s=0.06).longest_s == 0.0
    with pytest.raises(ValueError, match="longest_s=-1"):
        Window(window_s=0.02, max_batch=4, longest_s=-1)


def test_closed_or_zero_window_holds_nothing_back():
    w = Window(window_s=0.02, max_batch=4)
    assert not w.is_open
    assert w.should_close(5.0, 1) and w.remaining(5.0) == 0.0
    w.open(5.0)
    w.close()
    assert not w.is_open and w.should_close(5.0, 1)
    z = Window(window_s=0, max_batch=4)
    z.open(5.0)
    assert z.should_close(5.0, 1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"window_s": -0.1, "max_batch": 4}, "window_s=-0.1"),
        ({"window_s": float("nan"), "max_batch": 4}, "window_s=nan"),
        ({"window_s": float("inf"), "max_batch": 4}, "window_s=inf"),
        ({"window_s": "20ms", "max_batch": 4}, "window_s='20ms'"),
        ({"window_s": 0.02, "max_batch": 0}, "max_batch=0"),
    ],
)
def test_window_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Window(**kwargs)


times = st.floats(-1e6, 1e6, allow_nan=False)


@given(
    st.floats(0, 10),
    st.floats(0, 20),
    st.integers(1, 64),
    times,
    st.lists(st.floats(0, 30), max_size=5),
    times,
    st.integers(0, 128),
)
def test_window_remaining_stays_in_range_and_agrees_with_should_close(
    window_s, longest_s, max_batch, opened, arrivals, now, count
):
    w = Window(window_s=window_s, max_batch=max_batch, longest_s=longest_s)
    w.open(opened)
    for a in arrivals:
        w.arrived(opened + a)
    left = w.remaining(now)
    assert 0.0 <= left <= max(window_s, longest_s)
    assert w.should_close(now, count) == (count >= max_batch or left == 0.0)
    if now >= opened + max(window_s, longest_s):
        assert w.should_close(now, count)
    if opened <= now < opened + window_s and count < max_batch:  # not closed before window_s
        assert not w.should_close(now, count)
