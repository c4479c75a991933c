"""Writing a job's stream to a terminal or a pipe, honouring ``reset`` chunks.

A ``reset`` chunk means the job restarted (its worker died) and the text shown so far is
void. On a terminal the printer erases it, so what stays on screen is the result; when
the output is a pipe or a file, erasing is impossible, so it writes :data:`RESTART_MARK`
on a line of its own: the text after the last mark is the result.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from typing import TextIO

from rich.cells import cell_len

from mlxq.producer.codec import Chunk

#: The line that marks a restart in non-terminal output (with the job id and attempt).
RESTART_MARK = "--- mlxq: job {job_id} restarted (attempt {attempt}); the text above is void ---"
# Control characters other than newline would move the cursor (or be terminal escapes a
# model made up): on a terminal they show as U+FFFD, and tabs as spaces, so the printer
# knows how many rows its text takes.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_ERASE_BELOW = "\x1b[J"
_CLEAR_ALL = "\x1b[H\x1b[2J\x1b[3J"  # home, clear screen, clear scrollback


def screen_rows(text: str, width: int) -> int:
    """Rows ``text`` takes on a terminal ``width`` cells wide, from column 0."""
    width = max(1, width)
    return sum(max(1, math.ceil(cell_len(line) / width)) for line in text.split("\n"))


def for_terminal(text: str, column: int) -> str:
    """``text`` made safe to show from ``column`` of a logical line: controls replaced,
    tabs expanded to the next multiple of 8."""
    text = _CONTROL.sub("\ufffd", text)
    if "\t" not in text:
        return text
    out = []
    for i, piece in enumerate(text.split("\t")):
        if i:
            out.append(" " * (8 - column % 8))
            column += 8 - column % 8
        out.append(piece)
        column = cell_len(piece.rpartition("\n")[2]) if "\n" in piece else column + cell_len(piece)
    return "".join(out)


class StreamPrinter:
    """Prints one job's chunks to ``out`` as they come.

    Args:
        job_id: The job's id (named in the restart mark).
        out: Where the text goes; a terminal is detected with ``isatty()``.
    """

    def __init__(self, job_id: str, out: TextIO) -> None:
        self.job_id, self.out = job_id, out
        self.tty = out.isatty()
        self.shown = ""  # what is on screen since the last reset

    def write(self, chunk: Chunk) -> None:
        if chunk.kind == "reset":
            self.reset(chunk.attempt)
        elif chunk.text:
            text = chunk.text
            if self.tty:
                text = for_terminal(text, cell_len(self.shown.rpartition("\n")[2]))
            self.out.write(text)
            self.shown += text
        if chunk.final:
            self.out.write("\n")
        self.out.flush()

    def reset(self, attempt: int) -> None:
        """Void what was shown: erase it on a terminal, else mark the restart."""
        if not self.tty:
            mark = RESTART_MARK.format(job_id=self.job_id, attempt=attempt)
            self.out.write(f"\n{mark}\n")
        elif self.shown:
            size = _terminal_size(self.out)
            rows = screen_rows(self.shown, size.columns)
            if rows < size.lines:  # all of it is still on screen: go back up and erase
                up = f"\x1b[{rows - 1}A" if rows > 1 else ""
                self.out.write(f"\r{up}{_ERASE_BELOW}")
            else:  # part of it scrolled away: only a clear reaches it
                self.out.write(_CLEAR_ALL)
        self.shown = ""
        self.out.flush()


def _terminal_size(out: TextIO) -> os.terminal_size:
    try:
        return os.get_terminal_size(out.fileno())
    except (OSError, ValueError):
        return shutil.get_terminal_size()
