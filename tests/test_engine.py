"""The MLX engine on the tiny model: row alignment, seeded rows, text assembly."""

from __future__ import annotations

import dataclasses

import pytest

from mlxq.producer.params import GenerationRequest, SamplingParams

mlx_lm = pytest.importorskip("mlx_lm")

from kvcheck import padding_agrees  # noqa: E402

from mlxq.worker.engine import Engine  # noqa: E402
from mlxq.worker.jobs import Job, apply_deltas  # noqa: E402
from mlxq.worker.rows import RowStatus  # noqa: E402


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return mlx_lm.load(str(tiny_model))


def _engine(loaded, max_batch=8) -> Engine:
    model, tok = loaded
    return Engine(model, tok, max_batch=max_batch)


def _req(prompt: str, n: int, **sp) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_tokens=n, sampling=SamplingParams(**sp))


def _job(engine: Engine, name: str, req: GenerationRequest) -> Job:
    job = Job(name, req, engine.encode(req))
    job.start("exec")
    return job


def _run(
    engine: Engine, jobs: dict[str, GenerationRequest], *, remove_after=None, add_later=None
) -> dict[str, list[int]]:
    """Run jobs to the end; optionally remove some after N steps and add others then."""
    records = {j: _job(engine, j, req) for j, req in jobs.items()}
    engine.add(list(records.values()))
    steps = 0
    while engine.active:
        apply_deltas(engine.step())
        padding_agrees(engine)
        steps += 1
        if remove_after and steps == remove_after[0]:
            engine.remove([records[j] for j in remove_after[1]])
        if add_later and steps == add_later[0]:
            later = {j: _job(engine, j, req) for j, req in add_later[1].items()}
            records.update(later)
            engine.add(list(later.values()))
    return {j: r.token_ids for j, r in records.items()}


def _solo(loaded, name: str, req: GenerationRequest) -> list[int]:
    return _run(_engine(loaded), {name: req})[name]


def test_rows_keep_their_own_params_through_remove_then_extend(loaded):
    greedy = _req("The harbour at dawn", 24)
    seeded = _req("A list of numbers", 24, temperature=1.0, top_k=50, seed=1234)
    hot = _req("Something else", 40, temperature=1.5)
    newcomer = _req("The harbour at dawn", 24)  # greedy: any stale row state would show
    late_seeded = _req("Late arrival", 16, temperature=0.9, top_p=0.95, seed=99)
    engine = _engine(loaded)
    got = _run(
        engine,
        {"greedy": greedy, "seeded": seeded, "hot": hot},
        remove_after=(5, ["hot"]),
        add_later=(6, {"new": newcomer, "late": late_seeded}),
    )
    assert got["greedy"] == _solo(loaded, "g", greedy)
    assert got["seeded"] == _solo(loaded, "s", seeded)
    assert got["new"] == _solo(loaded, "n", newcomer)
    assert got["late"] == _solo(loaded, "l", late_seeded)
    c = engine.counters
    assert c.vectorized_steps == c.decode_steps == c.sampler_calls > 0
    # Where the time went: rows prefilled, joined, decoded, cut out.
    stages = c.stages.snapshot()
    for stage in ("decode", "prefill", "first_token", "rows_join", "rows_leave", "detokenize"):
        assert stages.get(stage, 0) > 0, stage


def test_rows_finishing_at_different_steps_stay_aligned(loaded):
    jobs = {
        f"j{i}": _req(f"Prompt number {i}", 3 + 5 * i, seed=i, temperature=0.8) for i in range(5)
    }
    got = _run(_engine(loaded), jobs)
    for name, req in jobs.items():
        assert got[name] == _solo(loaded, name, req)
        assert len(got[name]) <= req.max_tokens


def test_rows_leaving_prefill_at_different_passes_decode_as_alone(loaded):
    """With a 16-token prefill pass, prompts of about 5, 40 and 90 tokens leave prefill
    after one, three and six passes: the batch is split part by part (mlx-lm's split),
    not handed over whole as when every row leaves at once."""
    model, tok = loaded
    prompts = {
        "short": "The harbour at dawn",
        "mid": " ".join(["the boats go out"] * 8),
        "long": " ".join(["gulls over the quay at dusk"] * 14),
    }
    jobs = {name: _req(p, 12) for name, p in prompts.items()}

    def engine() -> Engine:
        return Engine(model, tok, max_batch=8, prefill_step_size=16)

    lengths = sorted(len(engine().encode(r)) for r in jobs.values())
    assert lengths[0] <= 16 < lengths[1] <= 48 < lengths[2]
    got = _run(engine(), jobs)
    for name, req in jobs.items():
        assert got[name] == _run(engine(), {name: req})[name]


def test_multibyte_text_is_never_split(loaded):
    _, tok = loaded
    engine = _engine(loaded)
    text = "naïve café 日本語です 😀 ok"
    job = _job(engine, "mb", _req("x", 64))
    engine.add([job])
    (row,) = engine._rows.values()
    pieces = []
    for t in tok.encode(text, add_special_tokens=False):
        job.apply(engine._on_token(row, t, None, None))
        pieces.append(job.chunks_due(0.0, 0.0)[0].text if job.has_output else "")
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_stop_strings_end_the_row_and_are_not_emitted(loaded):
    _, tok = loaded
    engine = _engine(loaded)
    job = _job(engine, "s", GenerationRequest(prompt="x", max_tokens=64, stop=("STOP",)))
    engine.add([job])
    (row,) = engine._rows.values()
    for t in tok.encode("one two STOP three", add_special_tokens=False):
        job.apply(engine._on_token(row, t, None, None))
        if job.choices[0].finish_reason:
            break
    assert job.choices[0].finish_reason == "stop" and "".join(job.text) == "one two "
    assert engine.active == 0
    assert row.status is RowStatus.FINISHED


def test_a_row_started_beside_riders_takes_passes_of_its_own_rows(loaded):
    """A chat row and a sweep's refill start together beside a busy batch (a job of a
    higher level makes the free rows fill at once): the chat row's prefill holds its row
    alone and feeds its last prompt token, and its first token comes out of that step; the
    refill's rows are prefilled in the next call and still ride (no first-token pass of
    theirs). No row takes a first-token pass. Every row's tokens are those it makes alone."""
    engine = _engine(loaded)
    busy = {f"b{i}": _job(engine, f"b{i}", _req(f"Busy row {i}", 40)) for i in range(4)}
    engine.add(list(busy.values()))
    for _ in range(3):
        apply_deltas(engine.step())
    before = dict(engine.counters.prefill_batch_sizes)
    passes, fed = engine.counters.first_token_passes, engine.counters.first_tokens_from_prefill
    chat = _job(engine, "chat", _req("A chat turn arrives", 8))
    refill = {f"r{i}": _job(engine, f"r{i}", _req(f"Sweep row {i}", 8)) for i in range(3)}
    engine.add([chat])
    engine.add(list(refill.values()), ride=True)
    apply_deltas(engine.step())
    assert chat.token_ids and not any(j.token_ids for j in refill.values())
    while engine.active:
        apply_deltas(engine.step())
    new = {
        n: engine.counters.prefill_batch_sizes.get(n, 0) - before.get(n, 0)
        for n in engine.counters.prefill_batch_sizes
    }
    assert new.get(1) == 1 and new.get(3) == 1, new
    assert engine.counters.first_token_passes == passes
    assert engine.counters.first_tokens_from_prefill == fed + 1
    assert chat.token_ids == _solo(loaded, "chat", _req("A chat turn arrives", 8))
    for name, job in refill.items():
        assert job.token_ids == _solo(loaded, name, _req(f"Sweep row {name[1:]}", 8))


def test_riders_wait_out_one_call_at_most_for_rows_that_do_not_ride(loaded):
    """Chat rows coming call after call never keep a refill waiting: its riders step
    aside for one call's passes, then go in with the next call's rows, whatever they are."""
    engine = _engine(loaded)
    busy = [_job(engine, f"b{i}", _req(f"Busy row {i}", 40)) for i in range(2)]
    engine.add(busy)
    apply_deltas(engine.step())
    refill = [_job(engine, f"r{i}", _req(f"Sweep row {i}", 8)) for i in range(2)]
    engine.add([_job(engine, "c0", _req("First chat", 8))])
    engine.add(refill, ride=True)
    apply_deltas(engine.step())
    assert len(engine._gen._unprocessed_sequences) == 2  # the riders waited this call
    engine.add([_job(engine, "c1", _req("Second chat", 8))])
    apply_deltas(engine.step())
    assert not engine._gen._unprocessed_sequences  # not a second time
    while engine.active:
        apply_deltas(engine.step())
    for i, job in enumerate(refill):
        assert job.token_ids == _solo(loaded, f"r{i}", _req(f"Sweep row {i}", 8))


def test_prompt_longer_than_the_context_is_refused(loaded):
    engine = _engine(loaded)
    with pytest.raises(ValueError, match="context"):
        engine.encode(_req("word " * 3000, 16))


@pytest.mark.parametrize(("ride", "calls"), [(False, 1), (True, 3)], ids=["own-pass", "rides"])
def test_a_row_added_beside_a_busy_batch_has_its_first_token_at_once(loaded, ride, calls):
    """Beside a busy batch, a new row's prefill and first-token pass run before the
    batch's decode step, so its first token comes out of the very step it is prefilled in
    (mlx-lm's order, decode then prefill, takes three); a row that rides takes no pass of
    its own: the next step feeds its last prompt token and the one after emits its first.
    Its tokens are those it makes alone either way."""
    engine = _engine(loaded)
    busy = {f"b{i}": _job(engine, f"b{i}", _req(f"Busy row {i}", 40)) for i in range(4)}
    engine.add(list(busy.values()))
    for _ in range(3):
        apply_deltas(engine.step())
    new = _job(engine, "new", _req("A chat turn arrives", 8))
    engine.add([new], ride=ride)
    steps = 0
    while not new.token_ids:
        apply_deltas(engine.step())
        steps += 1
    assert steps == calls
    while engine.active:
        apply_deltas(engine.step())
    assert new.token_ids == _solo(loaded, "new", _req("A chat turn arrives", 8))


def test_a_traced_decode_step_notes_how_many_of_its_rows_sample(loaded, tmp_path, monkeypatch):
    # What an interactive row costs a greedy sweep's step is read from this note
    # (ops/stage_trace.py: "decode, all greedy" against "decode, some sampled").
    import json

    from mlxq.worker import stages

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(stages.TRACE_ENV, str(path))
    engine = _engine(loaded)
    _run(
        engine,
        {"g": _req("a greedy row", 6, temperature=0.0)},
        add_later=(2, {"s": _req("a sampled row", 2, temperature=0.7, seed=3)}),
    )
    engine.counters.stages.close()
    steps = [x for x in map(json.loads, path.read_text().splitlines()) if x["stage"] == "decode"]
    assert {x["sampled"] for x in steps} == {0, 1}
    assert all(x["sampled"] <= x["rows"] for x in steps)


@pytest.mark.parametrize("buckets", [False, True], ids=["unpadded", "bucketed"])
def test_a_row_fed_by_its_prefill_decodes_as_with_a_pass_of_its_own(loaded, buckets):
    """A prefill that ends its rows' prompts feeds their last tokens too, and their first
    token comes from its logits: one pass fewer per row, and the same tokens and log-probs
    as mlx-lm's extra pass gives, for prompts of every length (one longer than a prefill
    step, whose last chunk is fed), greedy and seeded, alone and beside a busy batch, with
    rows of padding under them where the pass is bucketed."""
    model, tok = loaded
    prompts = ["Hi", "The harbour at dawn", " ".join(["gulls over the quay"] * 9)]
    reqs = {f"g{i}": _req(p, 10) for i, p in enumerate(prompts)}
    reqs |= {f"s{i}": _req(p, 10, temperature=0.9, seed=i) for i, p in enumerate(prompts)}
    reqs = {n: dataclasses.replace(r, logprobs=True) for n, r in reqs.items()}

    def run(fed: bool) -> tuple[dict, int, int]:
        engine = Engine(
            model, tok, max_batch=8, prefill_step_size=16, prefill_buckets=buckets, fed_prefill=fed
        )
        records = {n: _job(engine, n, r) for n, r in reqs.items()}
        busy = _job(engine, "busy", _req("Busy row", 30))
        engine.add([busy])
        apply_deltas(engine.step())
        names = list(records)
        engine.add([records[n] for n in names[:5]])  # beside the busy row; bucketed: 6 rows
        apply_deltas(engine.step())
        engine.add([records[n] for n in names[5:]])
        while engine.active:
            apply_deltas(engine.step())
            padding_agrees(engine)
        out = {
            n: (j.token_ids, [e["logprob"] for e in j.choices[0].logprobs])
            for n, j in records.items()
        }
        c = engine.counters
        return out, c.first_token_passes, c.first_tokens_from_prefill

    fed, fed_passes, from_prefill = run(True)
    own, own_passes, _ = run(False)
    assert from_prefill == len(reqs) + 1 and fed_passes == 0 < own_passes  # and the busy row
    assert {n: t for n, (t, _) in fed.items()} == {n: t for n, (t, _) in own.items()}
    for n, (_, lps) in fed.items():
        assert lps == pytest.approx(own[n][1], abs=1e-4), n
