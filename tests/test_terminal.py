"""The stream printer on a terminal (emulated by pyte) and in a pipe: after a reset, what
stays is the result alone."""

from __future__ import annotations

import io

import pyte
import pytest
from opshelp import rows_of

from mlxq.producer.codec import Chunk
from mlxq.producer.terminal import RESTART_MARK, StreamPrinter, for_terminal, screen_rows


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        raise io.UnsupportedOperation  # the size then comes from COLUMNS / LINES


def _run(out: io.StringIO, first: str, result: str) -> None:
    p = StreamPrinter("job-1", out)
    p.write(Chunk(1, first))
    p.write(Chunk(first_seq := 2**20 + 1, kind="reset", attempt=2))
    p.write(Chunk(first_seq + 1, result[:7], attempt=2))
    p.write(Chunk(first_seq + 2, result[7:], finish_reason="stop", attempt=2))


@pytest.mark.parametrize(
    "first",
    [
        "void text\twith a tab\nand a second line",
        "a line that wraps " * 9,  # wider than the terminal: several rows
        "scrolled away\n" * 40,  # taller than the terminal: only a clear reaches it
    ],
)
def test_a_reset_on_a_terminal_leaves_only_the_result(monkeypatch, first):
    cols, lines = 40, 12
    monkeypatch.setenv("COLUMNS", str(cols))
    monkeypatch.setenv("LINES", str(lines))
    out = FakeTerminal()
    result = "The result,\x1b[31m safe\tand whole."
    _run(out, first, result)
    screen = pyte.Screen(cols, lines)
    pyte.Stream(screen).feed(out.getvalue().replace("\n", "\r\n"))
    shown = [row.rstrip() for row in screen.display]
    while shown and not shown[-1]:
        shown.pop()
    assert shown == rows_of(for_terminal(result, 0), cols)


def test_a_reset_in_a_pipe_is_marked():
    out = io.StringIO()
    _run(out, "void", "the result")
    mark = RESTART_MARK.format(job_id="job-1", attempt=2)
    assert out.getvalue() == f"void\n{mark}\nthe result\n"


def test_screen_rows():
    assert screen_rows("", 10) == 1
    assert screen_rows("x" * 10, 10) == 1
    assert screen_rows("x" * 11, 10) == 2
    assert screen_rows("ab\n\ncd", 10) == 3
    assert screen_rows("日本", 3) == 2  # wide characters take two cells
