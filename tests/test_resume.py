"""Streams across a job's restart or a log that lost chunks (pure: no Redis, no model):
the gateway's cut of repeated text, the follow protocol's end."""

from __future__ import annotations

import pytest

from mlxq.producer.codec import Chunk
from mlxq.producer.gateway.resume import Resume, Void
from mlxq.producer.stream import Follow


def _c(seq: int, text: str, index: int = 0) -> Chunk:
    return Chunk(seq, text, [1] * len(text), index=index)


def test_a_restart_that_repeats_the_text_goes_on_where_the_client_is():
    r = Resume()
    sent = [r.admit(_c(1, "Once up")).text, r.admit(_c(2, "on a")).text]
    r.reset()
    again = [r.admit(_c(9, "Once")).text, r.admit(_c(10, " upon a time")).text]
    assert sent + again == ["Once up", "on a", "", " time"]
    assert r.admit(_c(11, ", there")).text == ", there"


def test_a_restart_with_another_text_voids_the_stream():
    r = Resume()
    r.admit(_c(1, "Once upon"))
    r.reset()
    with pytest.raises(Void):
        r.admit(_c(9, "Twice"))


def test_choices_are_followed_apart_and_logprobs_cannot_be_cut():
    r = Resume()
    r.admit(_c(1, "a", index=0))
    r.admit(_c(2, "b", index=1))
    r.reset()
    assert r.admit(_c(9, "ab", index=0)).text == "b"
    with pytest.raises(Void):
        r.admit(Chunk(10, "b", [1], index=1, logprobs=[{"token": "b", "logprob": 0.0}]))


def _followed_with_a_gap() -> Follow:
    f = Follow("j", None)
    f.cur.accept([Chunk(1, "Hello", [1], attempt=1)], from_log=True)
    f.cur.accept([Chunk(3, " there", [3], attempt=1)], from_log=False)  # seq 2 never came
    assert f.cur.gap
    return f


def test_a_log_that_lost_chunks_ends_with_the_rest_of_the_result_text():
    got = _followed_with_a_gap().on_end("finished", "Hello world", [1, 2], "stop", None, None)
    assert [(c.kind, c.text, c.finish_reason) for c in got] == [("tokens", " world", "stop")]


def test_a_log_that_lost_chunks_of_another_text_ends_with_a_reset_and_the_whole_text():
    got = _followed_with_a_gap().on_end("finished", "Goodbye", [7], "length", None, None)
    assert [(c.kind, c.text, c.finish_reason) for c in got] == [
        ("reset", "", None),
        ("tokens", "Goodbye", "length"),
    ]
    assert got[1].seq > got[0].seq > 1 and got[1].attempt == 2
