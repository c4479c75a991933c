"""Stop strings over streamed text (pure logic)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from mlxq.batching.stops import StopMatcher


def _run(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit:
            return out, True
    out.append(m.flush())
    return out, False


def test_cuts_before_the_stop_string_across_pieces():
    out, hit = _run(["Hello wo", "rld! EN", "D more"], ["END"])
    assert hit and "".join(out) == "Hello world! "
    assert out[1] == "rld! "  # "EN" was held back, never streamed


def test_no_stops_passes_text_through():
    assert _run(["a", "b"], []) == (["a", "b", ""], False)


def test_held_tail_is_flushed_when_no_stop_comes():
    out, hit = _run(["abc E", "N"], ["END"])
    assert not hit and "".join(out) == "abc EN"


alphabet = st.text(alphabet="abE N日😀", max_size=40)


@given(
    text=alphabet,
    cuts=st.lists(st.integers(0, 40), max_size=8),
    stops=st.lists(st.text(alphabet="abE N日😀", min_size=1, max_size=4), max_size=3),
)
def test_streamed_text_is_the_text_up_to_the_first_stop(text, cuts, stops):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, hit = _run(pieces, stops)
    joined = "".join(out)
    firsts = [i for i in (text.find(s) for s in stops) if i >= 0]
    if firsts:
        # The match is found in the stream as soon as it is complete, so the cut is at the
        # earliest stop string that ends first; it can never be past the first occurrence.
        assert hit
        assert not any(s in joined for s in stops)
        assert text.startswith(joined)
    else:
        assert not hit and joined == text
