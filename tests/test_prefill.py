"""How new rows go into a decoding batch: the gather rule and the prefill buckets (pure), then
the engine's bucketed prefills and gathered refills on the tiny model (no Redis)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxq.batching.prefill import PASS_STEPS, Gather, bucket, prefill_shape
from mlxq.producer.logits_params import LogitsParams
from mlxq.producer.params import GenerationRequest, SamplingParams

# -- the gather rule ----------------------------------------------------------------------------


def left(*steps: int):
    return lambda: list(steps)


BUSY = [200] * 32  # rows running on long after any hold: a busy batch


def test_free_rows_wait_for_rows_about_to_end_while_a_queue_waits():
    g = Gather(hold_steps=4)
    # 8 rows free, 100 jobs waiting, a cohort of 3 rows ends in 2 steps: wait for it.
    assert not g.ready(10, 8, 100, left(2, 2, 2, 30))
    assert not g.ready(11, 8, 100, left(1, 1, 1, 29))
    assert g.held_steps == 2
    assert g.ready(12, 11, 100, left(28))  # it ended: all go in together
    assert g.since is None


def test_nothing_waits_without_a_queue_an_ending_row_or_a_running_row():
    g = Gather(hold_steps=4)
    assert g.ready(0, 8, 8, left(1, 1))  # every waiting job has a row now
    assert g.ready(0, 8, 100, left(40, 50))  # no row ends within the hold
    assert g.ready(0, 64, 100, left())  # idle: the idle window gathers, not this
    assert g.ready(0, 8, 100, left(7, 9))  # ends past the hold (4 steps)
    assert g.held_steps == 0
    assert not g.ready(0, 0, 100, left(1)) and not g.ready(0, 8, 0, left(1))  # nothing to do
    assert Gather(hold_steps=0).ready(0, 8, 100, left(1, 1))  # off


def test_the_hold_is_bounded_from_the_first_step_put_off():
    g = Gather(hold_steps=3)
    assert not g.ready(5, 8, 100, left(3, *BUSY))
    assert not g.ready(6, 8, 100, left(2, *BUSY))
    assert not g.ready(7, 8, 100, left(1, *BUSY))
    assert g.ready(8, 8, 100, left(9, *BUSY))  # three steps put off: admit, whatever ends next
    assert not g.ready(9, 4, 100, left(1, *BUSY))  # a new hold starts afresh


def test_a_hold_given_for_one_decision_replaces_the_rules_own():
    g = Gather(hold_steps=4)
    assert g.ready(0, 1, 100, left(9, *BUSY))  # ends past the rule's 4 steps: admit
    assert not g.ready(1, 1, 100, left(8, *BUSY), hold_steps=16)  # a sweep's level: wait
    assert g.ready(2, 1, 100, left(7, *BUSY), hold_steps=0)  # off for this decision
    assert not g.ready(3, 1, 100, left(6, *BUSY), hold_steps=16)
    assert g.ready(20, 1, 100, left(1, *BUSY), hold_steps=16)  # 16 steps since the first


def test_rows_stand_idle_no_longer_than_the_refill_they_save_would_cost():
    # One row freed early waits long for a cohort about to end: 40 idle row-steps against a
    # refill that would stall 64 rows for two steps.
    g = Gather(hold_steps=64)
    assert not g.ready(0, 1, 100, left(40, *[40] * 62))
    # Half the batch free waits for 4 steps (32 x 4 = 128 = 2 x 64), not 5.
    assert Gather(hold_steps=64).ready(0, 32, 100, left(5, *[5] * 31))
    g = Gather(hold_steps=64)
    assert not g.ready(0, 32, 100, left(4, *[4] * 31))
    # What stood idle counts: the next end is 4 steps off again (the cohort waited for
    # ended early, by its own stop), and 32 row-steps spent + 32 x 4 passes the cost.
    assert g.ready(1, 32, 100, left(4, *[4] * 31))
    assert g.idle == 32 and g.since is None
    assert not g.ready(2, 32, 100, left(4, *[4] * 31))  # a new hold counts afresh
    assert g.idle == 32


def test_steps_left_is_asked_only_when_there_is_something_to_decide():
    def never() -> list[int]:
        raise AssertionError("asked")

    g = Gather(hold_steps=4)
    assert not g.ready(0, 0, 10, never)
    assert g.ready(0, 10, 10, never)
    assert Gather(hold_steps=0).ready(0, 1, 10, never)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_gather_names_a_bad_hold(bad):
    with pytest.raises(ValueError, match="hold_steps="):
        Gather(hold_steps=bad)


@given(
    st.integers(0, 6),
    st.lists(
        st.tuples(
            st.integers(0, 64), st.integers(0, 200), st.lists(st.integers(1, 40), max_size=64)
        ),
        min_size=1,
        max_size=60,
    ),
)
def test_no_job_is_held_longer_than_hold_steps_and_nothing_is_held_without_cause(hold, turns):
    g = Gather(hold_steps=hold)
    run = 0  # consecutive steps put off
    for step, (free, waiting, rows) in enumerate(turns):
        ok = g.ready(step, free, waiting, lambda rows=rows: rows)
        n = min(free, waiting)
        if n == 0:
            assert not ok
            run = 0
            continue
        if ok:
            run = 0
            continue
        run += 1
        assert run <= hold
        assert waiting > free and rows and min(rows) <= hold
        assert g.idle <= PASS_STEPS * (len(rows) + n)  # idle no longer than a refill costs
    assert g.held_steps <= len(turns)


# -- the buckets --------------------------------------------------------------------------------


def test_rows_and_lengths_round_to_a_few_buckets():
    rows = sorted({prefill_shape(r, 1, 64, 2048)[0] for r in range(1, 65)})
    assert rows == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    lengths = sorted({prefill_shape(1, n, 64, 2048)[1] for n in range(1, 129)})
    assert lengths == [16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    assert prefill_shape(17, 100, 64, 2048) == (24, 112)


def test_a_shape_never_passes_its_caps_nor_falls_below_what_it_holds():
    assert prefill_shape(40, 1900, 40, 2048) == (40, 2048)
    assert prefill_shape(50, 30, 40, 16) == (50, 30)  # past the caps already: as it is


@given(st.integers(1, 100_000), st.integers(1, 64), st.sampled_from([1, 2, 4, 8]))
def test_buckets_are_idempotent_and_bounded(n, floor, per_octave):
    b = bucket(n, floor, per_octave)
    assert b >= n and bucket(b, floor, per_octave) == b
    assert b == floor or b < n * (1 + 1 / per_octave)


@given(st.integers(1, 256), st.integers(1, 4096), st.integers(1, 256), st.integers(1, 4096))
def test_prefill_shapes_hold_their_prompts(rows, length, max_rows, max_length):
    r, n = prefill_shape(rows, length, max_rows, max_length)
    assert r >= rows and n >= length
    assert r <= max(rows, max_rows) and n <= max(length, max_length)


@pytest.mark.parametrize(("args", "field"), [((0, 5, 8, 8), "rows=0"), ((3, 0, 8, 8), "length=0")])
def test_prefill_shape_names_a_bad_field(args, field):
    with pytest.raises(ValueError, match=field):
        prefill_shape(*args)


# -- the engine ---------------------------------------------------------------------------------

mlx_lm = pytest.importorskip("mlx_lm")

from kvcheck import padding_agrees  # noqa: E402

from mlxq.worker.engine import Engine  # noqa: E402
from mlxq.worker.jobs import Job, apply_deltas  # noqa: E402


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return mlx_lm.load(str(tiny_model))


def _jobs(engine: Engine, reqs: list[GenerationRequest]) -> list[Job]:
    jobs = []
    for i, req in enumerate(reqs):
        job = Job(f"j{i}", req, engine.encode(req))
        job.start("exec")
        jobs.append(job)
    return jobs


def _run(engine: Engine, reqs: list[GenerationRequest], cohorts: list[int]) -> list[list[int]]:
    """Run ``reqs`` to the end, a cohort of the given size joining at each step."""
    jobs = _jobs(engine, reqs)
    todo, sizes = list(jobs), list(cohorts)
    while todo or engine.active:
        k = sizes.pop(0) if sizes else len(todo)
        if k and engine.free_slots:
            k = min(k, engine.free_slots)
            engine.add(todo[:k])
            todo = todo[k:]
        apply_deltas(engine.step())
        padding_agrees(engine)
    return [j.token_ids for j in jobs]


def _requests() -> list[GenerationRequest]:
    text = "the harbour at dawn, a lamp in the window of the old mill by the river"
    reqs = []
    for i in range(11):
        prompt = f"{text[: 8 + 6 * i]} {i}"
        sampling = SamplingParams(temperature=0.9, seed=100 + i) if i % 2 else SamplingParams()
        reqs.append(GenerationRequest(prompt=prompt, max_tokens=9 + i, sampling=sampling))
    return reqs


@pytest.mark.parametrize("cache", [0, 1 << 24])
def test_bucketed_prefills_give_the_tokens_of_unpadded_ones(loaded, cache):
    """Rows padded to a bucket's length, and padding rows under them, change no row's tokens
    (greedy and seeded rows, cohorts of several sizes, with and without a prompt cache, whose
    hits join with the rest of their prompts)."""
    model, tok = loaded
    reqs = _requests()
    plain = Engine(model, tok, max_batch=8, prompt_cache_bytes=cache, prefill_buckets=False)
    padded = Engine(model, tok, max_batch=8, prompt_cache_bytes=cache, prefill_buckets=True)
    for _ in range(2):  # the second round finds the first's prompts in the prompt cache
        assert _run(padded, reqs, [5, 1, 2]) == _run(plain, reqs, [5, 1, 2])
    shapes = padded.counters.prefill_shapes
    assert all(r in (1, 2, 3, 4, 6, 8) and n >= 16 and k >= n for r, n, k in shapes), shapes
    assert {r for r, _, _ in plain.counters.prefill_shapes} & {5}  # unpadded: as it came


def test_the_default_pads_only_on_cuda(loaded):
    model, tok = loaded
    engine = Engine(model, tok, max_batch=4, prefill_buckets=None)
    import mlx.core as mx

    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    assert engine.prefill_buckets is on_cuda


def test_gathered_refills_join_cohorts_of_equal_jobs(loaded):
    """Jobs of one length that started in cohorts a step apart (a gateway's burst)
    refill as one cohort once their rows wait for each other: fewer prefills, and no more
    decode steps (their first tokens come from their prefills, so a refill adds no step)."""
    model, tok = loaded

    def run(hold: int) -> tuple[int, int, list[list[int]]]:
        engine = Engine(model, tok, max_batch=8)
        gather = Gather(hold)
        no_eos = LogitsParams(min_tokens=6)  # every job runs its 6 tokens: equal lengths
        reqs = [
            GenerationRequest(prompt=f"job {i}", max_tokens=6, logits=no_eos) for i in range(40)
        ]
        jobs = _jobs(engine, reqs)
        arrivals, queue, waiting, step = [2, 0, 3, 0, 3], list(jobs), [], 0
        while queue or waiting or engine.active:
            k = arrivals.pop(0) if arrivals else len(queue)
            waiting, queue = waiting + queue[:k], queue[k:]
            free = engine.free_slots
            if gather.ready(step, free, len(waiting), engine.steps_left) and free:
                engine.add(waiting[:free])
                waiting = waiting[free:]
            apply_deltas(engine.step())
            step += 1
        c = engine.counters
        return sum(c.prefill_batch_sizes.values()), c.decode_steps, [j.token_ids for j in jobs]

    passes0, steps0, tokens0 = run(0)
    passes4, steps4, tokens4 = run(4)
    assert tokens4 == tokens0  # greedy: the same tokens, whatever the cohorts
    assert passes0 == 15  # three cohorts refill on their own, all five rounds
    assert passes4 < passes0 and steps4 <= steps0


# -- the worker's options -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"admit_hold_steps": -1}, "admit_hold_steps=-1"),
        ({"admit_hold_steps": 2.5}, "admit_hold_steps=2.5"),
        ({"prefill_buckets": "on"}, "prefill_buckets='on'"),
        ({"prefill_buckets": 1}, "prefill_buckets=1"),
    ],
)
def test_the_worker_config_names_a_bad_prefill_option(kw, field):
    from mlxq.worker.config import WorkerConfig

    with pytest.raises(ValueError, match=field):
        WorkerConfig(model="m", **kw)


def test_the_worker_options_reach_its_config():
    import argparse

    from mlxq.worker.cli import add_worker_arguments, config_from

    p = argparse.ArgumentParser()
    add_worker_arguments(p)
    base = ["--model", "m"]
    default = config_from(p.parse_args(base))
    assert (default.admit_hold_steps, default.prefill_buckets) == (None, None)  # auto
    auto = ["--admit-hold-steps", "AUTO", "--prefill-buckets", "auto"]
    assert config_from(p.parse_args([*base, *auto])).admit_hold_steps is None
    on = ["--admit-hold-steps", "0", "--prefill-buckets", "on"]
    chosen = config_from(p.parse_args([*base, *on]))
    assert (chosen.admit_hold_steps, chosen.prefill_buckets) == (0, True)
    assert config_from(p.parse_args([*base, "--prefill-buckets", "off"])).prefill_buckets is False
    assert default.fused_prefill is None  # auto
    for word, value in (("auto", None), ("on", True), ("off", False)):
        given = config_from(p.parse_args([*base, "--fused-prefill", word]))
        assert given.fused_prefill is value, word


def test_a_sweeps_waiting_rows_gather_longer_and_no_higher_levels_do():
    from mlxq.worker.config import WorkerConfig
    from mlxq.worker.schedule import LOWEST_HOLD_FACTOR, Scheduler

    def job(queue: str) -> Job:
        return Job(f"{queue}-job", GenerationRequest(prompt="x"), [1], queue=queue)

    levels = WorkerConfig("m", queues=("chat", "team-a,team-b", "sweeps"), admit_hold_steps=5)
    s = Scheduler(levels, None, None, None)  # type: ignore[arg-type]  # _hold reads levels only
    assert s._hold([job("sweeps"), job("sweeps")]) == LOWEST_HOLD_FACTOR * 5 == 20
    assert s._hold([job("sweeps"), job("team-b")]) is None  # a middle level's job waits too
    assert s._hold([job("chat")]) is None
    assert s._hold([]) is None
    one = WorkerConfig("m", queues=("a,b",), admit_hold_steps=5)  # one level: the rule's own
    assert Scheduler(one, None, None, None)._hold([job("a")]) is None  # type: ignore[arg-type]


def test_auto_hold_steps_are_more_where_mlx_runs_on_cuda_and_a_number_wins():
    from types import SimpleNamespace

    from mlxq.worker.config import CUDA_ADMIT_HOLD_STEPS, DEFAULT_ADMIT_HOLD_STEPS, WorkerConfig
    from mlxq.worker.schedule import hold_steps

    cuda, cpu = SimpleNamespace(on_cuda=True), SimpleNamespace(on_cuda=False)
    auto = WorkerConfig("m")
    assert hold_steps(auto, cuda) == CUDA_ADMIT_HOLD_STEPS == 16  # type: ignore[arg-type]
    assert hold_steps(auto, cpu) == DEFAULT_ADMIT_HOLD_STEPS == 4  # type: ignore[arg-type]
    assert hold_steps(auto, None) == 4
    assert hold_steps(WorkerConfig("m", admit_hold_steps=0), cuda) == 0  # type: ignore[arg-type]


def test_a_bad_hold_steps_value_names_itself(capsys):
    import argparse

    from mlxq.worker.cli import add_worker_arguments

    p = argparse.ArgumentParser()
    add_worker_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--admit-hold-steps", "lots"])
    assert "--admit-hold-steps: 'lots': give decode steps (an integer) or auto" in (
        capsys.readouterr().err
    )
