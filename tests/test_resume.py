"""The gateway's stream across a job's restart (pure: no Redis, no model)."""

from __future__ import annotations

import pytest

from mlxq.producer.codec import Chunk
from mlxq.producer.gateway.resume import Resume, Void


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
