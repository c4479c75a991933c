"""Generation options evals need, end to end: logprobs, penalties, logit_bias, n, stop
token ids and min_tokens, all on the one-call sampling path."""

from __future__ import annotations

import pytest

from mlxq.producer import Client

pytestmark = pytest.mark.e2e

PROMPT = "In the morning the travellers"


@pytest.fixture(scope="module")
def reference(tiny_model):
    """mlx-lm's own generate_step on the tiny model: greedy, with processors."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    model, tok = load(str(tiny_model))

    def run(n: int, **processors):
        procs = make_logits_processors(**processors) if processors else None
        prompt = mx.array(tok.encode(PROMPT))
        out = []
        for (token, logprobs), _ in zip(
            generate_step(prompt, model, logits_processors=procs), range(n), strict=False
        ):
            if token in tok.eos_token_ids:
                break
            top = mx.argsort(-logprobs)[:5].tolist()
            out.append((int(token), float(logprobs[token]), top))
        return out

    return run


def test_logprobs_are_mlx_lms_own(redis_server, queue_name, start_worker, reference):
    start_worker()
    client = Client(redis_server.url, queue=queue_name)
    res = client.submit(PROMPT, max_tokens=12, logprobs=True, top_logprobs=5).result(timeout=60)
    want = reference(12)
    assert res.token_ids == [t for t, _, _ in want]
    assert len(res.logprobs) == len(res.token_ids)
    for entry, (_, lp, _top) in zip(res.logprobs, want, strict=True):
        assert entry["logprob"] == pytest.approx(lp, abs=1e-4)
        assert len(entry["top_logprobs"]) == 5
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)
    assert "".join(e["token"] for e in res.logprobs) == res.text
    streamed = [
        e
        for c in client.job(client.submit(PROMPT, max_tokens=12, logprobs=True).id).stream(
            timeout=60
        )
        for e in (c.logprobs or [])
    ]
    assert [e["logprob"] for e in streamed] == pytest.approx([lp for _, lp, _ in want], abs=1e-4)


@pytest.mark.parametrize(
    "processors",
    [
        dict(repetition_penalty=1.5),
        dict(presence_penalty=1.5, frequency_penalty=1.0),
        dict(logit_bias={5: 8.0, 77: -100.0}),
    ],
)
def test_penalties_and_bias_are_mlx_lms_own(
    redis_server, queue_name, start_worker, reference, processors
):
    start_worker()
    client = Client(redis_server.url, queue=queue_name)
    res = client.submit(PROMPT, max_tokens=60, **processors).result(timeout=60)
    assert res.token_ids == [t for t, _, _ in reference(60, **processors)]
    assert res.token_ids != [t for t, _, _ in reference(60)], "the processors changed something"


def test_a_batch_mixing_penalties_and_logprobs_stays_one_call_a_step(
    redis_server, queue_name, start_worker
):
    from test_e2e import _worker_stats

    start_worker(max_batch=16, window_ms=300)
    client = Client(redis_server.url, queue=queue_name)
    kinds = [
        dict(),
        dict(logprobs=True, top_logprobs=3),
        dict(repetition_penalty=1.3),
        dict(presence_penalty=0.5, logit_bias={3: 2.0}),
        dict(temperature=0.8, seed=1),
        dict(min_tokens=4, temperature=1.0),
    ]
    jobs = client.submit_many(
        [dict(prompt=f"mix {i}", max_tokens=10, **kinds[i % len(kinds)]) for i in range(24)]
    )
    for j in jobs:
        j.result(timeout=120)
    stats = _worker_stats(redis_server, queue_name)
    assert stats["decode_steps"] > 0
    assert stats["vectorized_steps"] == stats["decode_steps"] == stats["sampler_calls"]


def test_n_samples_of_one_prompt(redis_server, queue_name, start_worker):
    start_worker(max_batch=8)
    client = Client(redis_server.url, queue=queue_name)
    job = client.submit(PROMPT, max_tokens=10, temperature=1.0, seed=5, n=3)
    chunks = list(job.stream(timeout=60))
    res = job.result(timeout=10)
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert res.text == res.choices[0].text
    assert res.usage["completion_tokens"] >= sum(len(c.token_ids) for c in res.choices)
    for c in res.choices:  # the stream, split by choice, is each choice's text
        assert "".join(x.text for x in chunks if x.index == c.index) == c.text
    assert chunks[-1].final and not any(x.final for x in chunks[:-1])
    again = client.submit(PROMPT, max_tokens=10, temperature=1.0, seed=5, n=3).result(timeout=60)
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in res.choices]
    alone = client.submit(PROMPT, max_tokens=10, temperature=1.0, seed=6).result(timeout=60)
    assert alone.token_ids == res.choices[1].token_ids, "choice i is seeded seed + i"


def test_stop_token_ids_and_min_tokens(redis_server, queue_name, start_worker):
    start_worker()
    client = Client(redis_server.url, queue=queue_name)
    free = client.submit(PROMPT, max_tokens=16).result(timeout=60)
    stop = free.token_ids[2]
    cut = client.submit(PROMPT, max_tokens=16, stop_token_ids=[stop]).result(timeout=60)
    assert cut.finish_reason == "stop" and stop not in cut.token_ids
    assert cut.token_ids == free.token_ids[: free.token_ids.index(stop)]
    first = free.token_ids[0]
    held = client.submit(PROMPT, max_tokens=16, stop_token_ids=[first], min_tokens=5)
    res = held.result(timeout=60)
    assert len(res.token_ids) >= 5 and first not in res.token_ids[:5]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(n=0), "n=0"),
        (dict(n=17), "n=17"),
        (dict(top_logprobs=21, logprobs=True), "top_logprobs=21"),
        (dict(top_logprobs=3), "top_logprobs=3"),
        (dict(presence_penalty=3), "presence_penalty=3"),
        (dict(repetition_penalty=0), "repetition_penalty=0"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(logit_bias={1: 500}), "logit_bias"),
        (dict(min_tokens=-1), "min_tokens=-1"),
        (dict(stop_token_ids=[-4]), "stop_token_ids=-4"),
    ],
)
def test_generation_options_are_checked_by_name(redis_server, queue_name, kwargs, field):
    with pytest.raises(ValueError, match=field):
        Client(redis_server.url, queue=queue_name).submit("x", **kwargs)


def test_token_ids_past_the_vocabulary_fail_in_the_worker(redis_server, queue_name, start_worker):
    from mlxq.producer import JobFailed

    start_worker()
    client = Client(redis_server.url, queue=queue_name)
    with pytest.raises(JobFailed, match="past the vocabulary"):
        client.submit("x", logit_bias={10**6: 1.0}, max_tokens=3).result(timeout=60)
