"""What ``mlxq run-batch`` takes, with its defaults, checked on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from mlxq.producer import keys

#: Jobs in Redis at once: 8 times the worker's default batch (32; 4 times a GPU's 64),
#: enough that the worker never waits for the next job, few enough that a sweep of
#: 100,000 lines never floods Redis.
DEFAULT_MAX_IN_FLIGHT = 256
#: Seconds between progress lines when stderr is not a terminal.
DEFAULT_PROGRESS_EVERY_S = 10.0
PROGRESS_MODES = ("auto", "bar", "plain", "off")
#: The longest input line read, its newline not counted: the gateway's body cap, so any
#: body the gateway takes fits on a line. A longer line is an error line, read past.
DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024
JOURNAL_SUFFIX = ".journal"


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """One run of a batch file.

    Args:
        input: The OpenAI Batch input file (JSON lines), or a stream (a pipe such as
            ``/dev/stdin``): read once, so its lines are not counted beforehand.
        output: Where answers go; an existing file means "resume": its custom_ids are
            skipped.
        errors: Where unrunnable lines are reported; None: the output file.
        queue: Run every line on this queue; None: each line's ``body.model``.
        redis_url: Redis URL.
        max_in_flight: Most jobs of this run in Redis at once.
        detach: On Ctrl-C, leave the jobs in flight running (a rerun collects them)
            instead of canceling them.
        progress: ``auto`` (a bar on a terminal, plain lines otherwise), ``bar``,
            ``plain`` or ``off``.
        progress_every_s: Seconds between plain progress lines.
        max_line_bytes: The longest input line read (its newline not counted); a longer
            one is reported as an error line (``line_too_long``) and read past, never held.

    Raises:
        ValueError: naming the field and the bad value.
    """

    input: Path
    output: Path
    errors: Path | None = None
    queue: str | None = None
    redis_url: str = keys.DEFAULT_REDIS_URL
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    detach: bool = False
    progress: str = "auto"
    progress_every_s: float = DEFAULT_PROGRESS_EVERY_S
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES

    def __post_init__(self) -> None:
        for name in ("input", "output", "errors"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        _readable(self.input)
        _writable("output", self.output, self.input)
        if self.errors is not None:
            _writable("errors", self.errors, self.input)
        if self.queue is not None and not 0 < len(self.queue) <= 128:
            raise ValueError(f"queue={self.queue!r}: must be 1 to 128 characters")
        m = self.max_in_flight
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= 1_000_000:
            raise ValueError(f"max_in_flight={m!r}: must be an integer in [1, 1000000]")
        if self.progress not in PROGRESS_MODES:
            raise ValueError(f"progress={self.progress!r}: must be one of {PROGRESS_MODES}")
        e = self.progress_every_s
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not math.isfinite(e) or e <= 0:
            raise ValueError(f"progress_every_s={e!r}: must be a number > 0")
        c = self.max_line_bytes
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 1 << 40:
            raise ValueError(f"max_line_bytes={c!r}: must be an integer in [1, 2**40]")

    @property
    def journal(self) -> Path:
        """``<output>.journal``: the ids of the jobs this sweep submitted."""
        return self.output.with_name(self.output.name + JOURNAL_SUFFIX)

    @property
    def streamed(self) -> bool:
        """The input is a stream (a pipe, a device), read once: not counted beforehand,
        and its end is where the stream ends."""
        return not self.input.is_file()

    @property
    def separate_errors(self) -> bool:
        return self.errors is not None and self.errors.resolve() != self.output.resolve()


def _readable(path: Path) -> None:
    """A regular file, or a stream (a pipe, ``/dev/stdin``, a character device)."""
    if path.is_dir():
        raise ValueError(f"input={str(path)!r}: is a folder: give the batch file")
    if not (path.is_file() or path.is_fifo() or path.is_char_device()):
        raise ValueError(f"input={str(path)!r}: no such file")


def _writable(name: str, path: Path, input_: Path) -> None:
    if path.resolve() == input_.resolve():
        raise ValueError(f"{name}={str(path)!r}: must not be the input file")
    if path.is_dir():
        raise ValueError(f"{name}={str(path)!r}: is a folder: give a file in it")
    # A run appends to its files, reads them back to resume, fsyncs them, and keeps a
    # journal beside the output: none of which a device or a pipe (/dev/null) allows.
    if path.exists() and not path.is_file():
        raise ValueError(
            f"{name}={str(path)!r}: not a regular file (a device or a pipe): run-batch "
            "resumes from its files and keeps a journal beside the output; give a file"
        )
    if not path.parent.is_dir():
        raise ValueError(f"{name}={str(path)!r}: its folder does not exist")
