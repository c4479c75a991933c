"""Rows paused and put back (the engine's part of priority scheduling): a paused job goes on
where it stopped, with the very tokens and text of a run that was never paused."""

from __future__ import annotations

import pytest

from mlxq.producer.logits_params import LogitsParams
from mlxq.producer.params import GenerationRequest, SamplingParams

mlx_lm = pytest.importorskip("mlx_lm")

from kvcheck import padding_agrees  # noqa: E402

from mlxq.worker.engine import Engine  # noqa: E402
from mlxq.worker.jobs import Job, apply_deltas  # noqa: E402

PAUSED = {
    "greedy": GenerationRequest(prompt="The harbour at dawn", max_tokens=24),
    "seeded": GenerationRequest(
        prompt="A list of numbers",
        max_tokens=24,
        sampling=SamplingParams(temperature=1.0, top_k=50, seed=1234),
    ),
    "processed": GenerationRequest(
        prompt="Tell me about the sea",
        max_tokens=24,
        n=2,
        sampling=SamplingParams(temperature=0.9, seed=7),
        logits=LogitsParams(repetition_penalty=1.3, min_tokens=20, logit_bias={5: 2.0}),
    ),
}
BYSTANDER = GenerationRequest(prompt="Something else entirely", max_tokens=40)


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return mlx_lm.load(str(tiny_model))


def _run(loaded, reqs, pause_at=None, resume_at=None, keep_kv=True, paused=(), cache=0):
    """Run jobs to their end; pause ``paused`` after ``pause_at`` steps (0: before the first
    step, in their prefill) and put them back after ``resume_at``."""
    engine = Engine(*loaded, max_batch=8, prompt_cache_bytes=cache)
    jobs = {name: Job(name, req, engine.encode(req)) for name, req in reqs.items()}
    for job in jobs.values():
        job.start("exec")
    engine.add(list(jobs.values()))
    steps, held = 0, [jobs[n] for n in paused]
    if pause_at == 0:
        assert engine.pause(held, keep_kv=keep_kv) > 0
    while engine.active or steps < (resume_at or 0):
        apply_deltas(engine.step())
        padding_agrees(engine)
        steps += 1
        if steps == pause_at:
            assert engine.pause(held, keep_kv=keep_kv) == sum(j.request.n for j in held)
            assert engine.free_slots == 8 - engine.active
        if steps == resume_at:
            engine.resume(held)
    out = {
        n: [(c.token_ids, "".join(c.text), c.finish_reason) for c in j.choices]
        for n, j in jobs.items()
    }
    return out, engine.counters


@pytest.fixture(scope="module")
def unpaused(loaded):
    return _run(loaded, {**PAUSED, "bystander": BYSTANDER})[0]


@pytest.mark.parametrize("cache", [0, 64 << 20], ids=["no-prompt-cache", "prompt-cache"])
@pytest.mark.parametrize("keep_kv", [True, False], ids=["kv-kept", "kv-dropped"])
def test_paused_rows_go_on_as_if_never_paused(loaded, unpaused, keep_kv, cache):
    got, c = _run(
        loaded,
        {**PAUSED, "bystander": BYSTANDER},
        pause_at=5,
        resume_at=9,
        keep_kv=keep_kv,
        paused=list(PAUSED),
        cache=cache,
    )
    assert got == unpaused
    assert c.preemptions == c.resumes == 4  # greedy, seeded, and both choices of processed
    recomputed = c.resume_tokens_recomputed
    assert recomputed == 0 if keep_kv else recomputed > 0
    assert c.vectorized_steps == c.decode_steps == c.sampler_calls > 0


def test_a_row_paused_in_its_prefill_starts_it_again(loaded, unpaused):
    got, c = _run(
        loaded, {**PAUSED, "bystander": BYSTANDER}, pause_at=0, resume_at=3, paused=["greedy"]
    )
    assert got == unpaused
    assert c.resume_tokens_recomputed == 0  # it had emitted nothing: a fresh prefill


def test_a_paused_row_can_be_removed(loaded):
    engine = Engine(*loaded, max_batch=4)
    job = Job("j", PAUSED["greedy"], engine.encode(PAUSED["greedy"]))
    job.start("exec")
    engine.add([job])
    apply_deltas(engine.step())
    apply_deltas(engine.step())
    assert engine.pause([job]) == 1 and engine.active == 0 and engine.free_slots == 4
    engine.remove([job])  # a cancel or a timeout while paused
    engine.resume([job])  # nothing left to put back
    assert engine.active == 0 and engine.step() == []


def test_min_tokens_counts_what_a_row_made_before_its_pause(loaded):
    eos = loaded[1].eos_token_id
    # End-of-sequence is all but certain once min_tokens lets it through: the row ends
    # at exactly min_tokens + 1 tokens only if the pause kept its count.
    req = GenerationRequest(
        prompt="Count with me",
        max_tokens=30,
        logits=LogitsParams(logit_bias={eos: 30.0}, min_tokens=9),
    )
    alone = _run(loaded, {"eos": req, "bystander": BYSTANDER})[0]
    assert len(alone["eos"][0][0]) == 9 and alone["eos"][0][2] == "stop"
    for keep_kv in (True, False):
        got, _ = _run(
            loaded,
            {"eos": req, "bystander": BYSTANDER},
            pause_at=4,
            resume_at=6,
            keep_kv=keep_kv,
            paused=["eos"],
        )
        assert got == alone


def test_a_resumed_row_pauses_again_only_once_fed_its_last_token(loaded, unpaused):
    """A resumed row rides: the step after it joins feeds it its last token. Until it made
    a token again it stays when asked to pause (its KV lacks that token); after, it pauses
    and goes on as if never paused, twice over."""
    engine = Engine(*loaded, max_batch=8)
    reqs = {**PAUSED, "bystander": BYSTANDER}
    jobs = {name: Job(name, req, engine.encode(req)) for name, req in reqs.items()}
    for job in jobs.values():
        job.start("exec")
    engine.add(list(jobs.values()))
    held = [jobs[n] for n in PAUSED]
    steps = 0
    while engine.active:
        apply_deltas(engine.step())
        steps += 1
        if steps == 4:
            assert engine.pause(held) == 4
        if steps == 6:
            engine.resume(held)
        if steps == 7:  # joined, not yet fed its last token
            assert engine.riding() == {j.id for j in held}
            assert engine.pause(held) == 0
        if steps == 9:
            assert engine.riding() == set()
            assert engine.pause(held) == 4
        if steps == 11:
            engine.resume(held)
    got = {
        n: [(c.token_ids, "".join(c.text), c.finish_reason) for c in j.choices]
        for n, j in jobs.items()
    }
    assert got == unpaused
    assert engine.counters.preemptions == engine.counters.resumes == 8
