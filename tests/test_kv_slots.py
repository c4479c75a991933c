"""Rows that keep their place in the batch's caches (``mlxq.worker.kv_slots``): a row that
leaves leaves its slot dead, a row that joins writes into one, and every row's tokens are
those of its run alone, on the decode pass as one sequence and on the model's own call."""

from __future__ import annotations

import itertools

import pytest

from mlxq.producer.params import GenerationRequest, SamplingParams

mlx_lm = pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
from kvcheck import padding_agrees  # noqa: E402

from mlxq.worker import kv_slots  # noqa: E402
from mlxq.worker.engine import Engine  # noqa: E402
from mlxq.worker.jobs import Job, apply_deltas  # noqa: E402
from mlxq.worker.kv_slots import CUT_COLUMNS  # noqa: E402

PASSES = pytest.mark.parametrize("one_sequence", [True, False], ids=["one-sequence", "own-call"])


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return mlx_lm.load(str(tiny_model))


def _req(prompt: str, n: int, **sp) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_tokens=n, sampling=SamplingParams(**sp))


class Batch:
    """An engine whose batch is looked at after every step."""

    def __init__(self, loaded, max_batch: int, one_sequence: bool) -> None:
        self.engine = Engine(*loaded, max_batch=max_batch, one_sequence=one_sequence)
        self.jobs: dict[str, Job] = {}
        self.seen: list[tuple[int, int, int]] = []  # (rows, slots, dead) after each step
        self.columns: list[int] = []  # the caches' end after each step

    def add(self, reqs: dict[str, GenerationRequest]) -> None:
        new = {n: Job(n, r, self.engine.encode(r)) for n, r in reqs.items()}
        for job in new.values():
            job.start("exec")
        self.jobs |= new
        self.engine.add(list(new.values()))

    @property
    def gen(self):
        return self.engine._gen._generation_batch

    def step(self) -> None:
        apply_deltas(self.engine.step())
        padding_agrees(self.engine)
        gen, rows = self.gen, len(self.gen.uids)
        if gen.prompt_cache:
            c = gen.prompt_cache[0]
            self.seen.append((rows, c.keys.shape[0], len(gen.slots.free)))
            self.columns.append(c._idx)
            held = max(len(t) for t in gen.tokens)
            assert c._idx - held < CUT_COLUMNS  # columns no row reaches are cut

    def run(self) -> dict[str, list[int]]:
        while self.engine.active:
            self.step()
        return {n: j.token_ids for n, j in self.jobs.items()}


def _alone(loaded, one_sequence: bool, reqs: dict[str, GenerationRequest]) -> dict:
    out = {}
    for name, req in reqs.items():
        b = Batch(loaded, 8, one_sequence)
        b.add({name: req})
        out |= b.run()
    return out


@PASSES
def test_a_row_joins_into_the_slot_a_row_left(loaded, one_sequence):
    first = {
        "long": _req("The harbour at dawn", 30),
        "short": _req("A list of numbers", 4),
        "seeded": _req("Something else", 30, temperature=1.0, top_k=50, seed=1234),
    }
    later = {"new": _req("Hi", 12, temperature=0.9, top_p=0.95, seed=99)}
    b = Batch(loaded, 8, one_sequence)
    b.add(first)
    while len(b.gen.uids) != 2:
        b.step()
    dead = list(b.gen.slots.free)
    keys = b.gen.prompt_cache[0].keys.shape
    assert len(dead) == 1 and keys[0] == 3  # the short row's slot, left in place
    b.add(later)
    while len(b.gen.uids) != 3:
        b.step()
    gen = b.gen
    assert gen.slots.free == [] and gen.prompt_cache[0].keys.shape[0] == 3
    assert gen.slots.slot(2) == dead[0]  # the new row, last in the lists, in the dead slot
    assert b.run() == _alone(loaded, one_sequence, first | later)


@PASSES
def test_a_row_longer_than_the_batch_joins_by_concatenation(loaded, one_sequence):
    first = {"a": _req("Hi", 20), "b": _req("Yo", 3, temperature=0.8, seed=5)}
    later = {"long": _req(" ".join(["gulls over the quay"] * 8), 6)}
    b = Batch(loaded, 8, one_sequence)
    b.add(first)
    while len(b.gen.uids) != 1:
        b.step()
    assert b.gen.slots.free  # b's slot, dead
    b.add(later)
    while len(b.gen.uids) != 2:
        b.step()
    assert b.gen.slots.free == [] and b.gen.prompt_cache[0].keys.shape[0] == 2
    assert b.gen.slots.refused == "a row longer than the batch"
    assert b.run() == _alone(loaded, one_sequence, first | later)


@PASSES
def test_a_sweep_refills_its_rows_in_place(loaded, one_sequence):
    """Rows end one by one and the waiting ones take their places: the caches keep their
    width, the columns no row reaches are cut now and then, and every row's tokens are its
    own."""
    prompts = ["The harbour at dawn", "A list of numbers", "Tell me", "Gulls", "Once upon"]
    reqs = {
        f"j{i}": _req(
            prompts[i % len(prompts)],
            4 + (i * 7) % 9,
            **({"temperature": 0.9, "seed": i} if i % 3 == 0 else {}),
        )
        for i in range(36)
    }
    b = Batch(loaded, 4, one_sequence)
    b.add(reqs)
    got = b.run()
    c = b.engine.counters
    # Most rows joined into dead slots; others began a batch whose rows had all ended, or
    # were longer than every row left after a cut (joined by a copy).
    assert c.rows_joined_in_place > 2 * c.rows_joined_by_copy + len(reqs) // 2
    assert {width for _, width, _ in b.seen} == {4}
    assert any(y < x for x, y in itertools.pairwise(b.columns))  # a cut
    assert got == _alone(loaded, one_sequence, reqs)


def test_rows_that_end_together_leave_their_slots_to_the_refill(loaded):
    """Nine rows end in one step: their slots wait, and the nine that come next join into
    them. Twelve rows at once, more than the nine dead slots, gather the live ones first
    and join by a copy."""
    first = {f"s{i}": _req("Once upon", 2) for i in range(9)} | {
        "a": _req("The harbour at dawn", 40),
        "b": _req("Tell me", 40, temperature=0.7, seed=3),
    }
    refill = {f"r{i}": _req("Gulls", 3, temperature=0.5, seed=i) for i in range(9)}
    more = {f"m{i}": _req("Hi", 4 + i % 3) for i in range(12)}
    b = Batch(loaded, 16, True)
    c = b.engine.counters

    def until(rows: int) -> None:
        while len(b.gen.uids) != rows:
            b.step()

    b.add(first)
    until(len(first))
    until(2)
    assert len(b.gen.slots.free) == 9 and b.gen.prompt_cache[0].keys.shape[0] == 11
    b.add(refill)
    until(11)
    assert (c.rows_joined_in_place, c.rows_joined_by_copy, c.slot_gathers) == (9, 0, 0)
    until(2)
    b.add(more)
    until(14)
    assert (c.rows_joined_in_place, c.rows_joined_by_copy, c.slot_gathers) == (9, 12, 1)
    assert b.gen.slots.free == [] and b.gen.prompt_cache[0].keys.shape[0] == 14
    assert b.gen.slots.refused == "fewer dead slots than rows"
    assert b.run() == _alone(loaded, True, first | refill | more)


def test_dead_slots_no_row_comes_for_are_let_go(loaded, monkeypatch):
    """A batch that shrank for good gathers its live slots once its dead ones have waited
    out IDLE_STEPS decode steps; the rows go on with their own tokens."""
    monkeypatch.setattr(kv_slots, "IDLE_STEPS", 5)
    reqs = {f"s{i}": _req("Once upon", 2) for i in range(5)} | {
        "a": _req("The harbour at dawn", 24),
        "b": _req("Tell me", 24, temperature=0.7, seed=3),
    }
    b = Batch(loaded, 8, True)
    b.add(reqs)
    b.step()
    while len(b.gen.uids) > 2:
        b.step()
    assert len(b.gen.slots.free) == 5
    for _ in range(5):
        b.step()
    assert b.engine.counters.slot_gathers == 0 and len(b.gen.slots.free) == 5
    b.step()
    b.step()
    assert b.engine.counters.slot_gathers == 1
    assert b.gen.slots.free == [] and b.gen.prompt_cache[0].keys.shape[0] == 2
    assert b.run() == _alone(loaded, True, reqs)


@pytest.mark.parametrize("given", ["0", ""], ids=["off", "cpu-default"])
def test_no_slot_stays_dead_when_off_and_on_the_cpu(loaded, monkeypatch, given):
    """``MLXQ_KV_SLOTS=0``, or unset where MLX computes on the CPU: every leave gathers
    the rows left, every join copies."""
    if given:
        monkeypatch.setenv("MLXQ_KV_SLOTS", given)
    else:
        monkeypatch.delenv("MLXQ_KV_SLOTS", raising=False)
        if mx.default_device().type == mx.DeviceType.gpu:
            pytest.skip("MLX computes on a GPU here: slots are on by default")
    reqs = {f"j{i}": _req("Once upon", 3 + i % 4) for i in range(10)}
    b = Batch(loaded, 4, True)
    b.add(reqs)
    got = b.run()
    c = b.engine.counters
    assert c.rows_joined_in_place == 0 and c.rows_joined_by_copy > 0
    assert b.gen.slots.refused == "slots off"
    assert all(dead == 0 for _, _, dead in b.seen)
    assert got == _alone(loaded, True, reqs)
