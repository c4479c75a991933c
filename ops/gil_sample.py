"""Which of a worker's threads hold the interpreter's lock, window by window (py-spy).

MLX releases the lock while it evaluates, and the decode step is mostly the host's work
(building and launching a pass's kernels), so the worker's other threads' Python (claims,
chat templates, writes, the metrics server) runs inside the decode step's time. py-spy
``record --gil`` samples only the thread that holds the lock: a thread's samples over a
window's seconds are its share of the lock. (On an H100 it found the decode thread
holding the lock on the line of its ``mx.async_eval`` launch too, though MLX's binding
lets it go there: docs/benchmarks.md.)

    python ops/bench_priority.py --parts turns --gil DIR ...   # one file per window
    python ops/gil_sample.py DIR [--frames 12]                 # the tables again

``--gil`` needs ``py-spy`` on PATH (or ``PY_SPY=...``) and leave to read the worker's
memory (ptrace). It samples without pausing the worker (``--nonblocking``), at 100 Hz.

``MLXQ_GIL_NATIVE=1``: every thread that runs, lock held or not, with its native frames
(``--native``, which pauses the worker for each sample), each sample counted by its
innermost named frame: where inside MLX's launch (kernels encoded, CUDA graphs
instantiated or updated, memory allocated) a decode thread spends its time. The tables
then read "the thread runs" for "the lock held".
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

RATE = 100  # samples a second


def native() -> bool:
    """Whether to sample running threads' native frames (``MLXQ_GIL_NATIVE=1``)."""
    return os.environ.get("MLXQ_GIL_NATIVE", "") == "1"


def exe() -> str:
    """The py-spy to run, or a clear error."""
    got = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if not got:
        raise SystemExit("--gil: no py-spy on PATH (pip install py-spy, or PY_SPY=/path)")
    return got


class Sampler:
    """One py-spy per window, on one process."""

    def __init__(self, pid: int, out: Path) -> None:
        self.pid, self.out, self.exe = pid, out, exe()
        out.mkdir(parents=True, exist_ok=True)
        self.running: list[subprocess.Popen[bytes]] = []

    def window(self, i: int, on: bool, seconds: float) -> None:
        """Sample the next ``seconds`` (whole, at least 1) into window ``i``'s file."""
        s = max(1, int(seconds))
        name = self.out / f"gil-{i:02d}-{'on' if on else 'off'}-{s}s"
        # Native frames need the worker paused for each sample: a slower worker, for
        # where its time goes, not for its pace.
        how = ["--native"] if native() else ["--gil", "--nonblocking"]
        cmd = [self.exe, "record", *how, "--threads", "--full-filenames"]
        cmd += ["-r", str(RATE)]
        cmd += ["-d", str(s), "-f", "raw", "-o", f"{name}.txt"]
        with open(f"{name}.log", "wb") as log:
            cmd += ["-p", str(self.pid)]
            self.running.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))

    def close(self, within: float = 30) -> None:
        for p in self.running:
            try:
                p.wait(within)
            except subprocess.TimeoutExpired:
                p.kill()


THREAD = re.compile(r"^thread \(\d+\): ?([^;]*);?")
FRAME = re.compile(r"^(.*) \(([^:]*):\d+\)$")


@dataclass
class Held:
    """The lock's samples in some windows: by thread, and by thread and frame."""

    seconds: float = 0.0
    threads: Counter[str] = field(default_factory=Counter)
    frames: Counter[tuple[str, str]] = field(default_factory=Counter)

    def add(self, path: Path, seconds: float) -> None:
        self.seconds += seconds
        for line in path.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not n.isdigit() or not (m := THREAD.match(stack)):
                continue
            thread = re.sub(r"\d+$", "", m.group(1) or "?")  # ThreadPool-3 -> ThreadPool-
            self.threads[thread] += int(n)
            frames = stack[m.end() :].split(";")
            key = innermost(frames) if native() else mlxq_frame(frames)
            self.frames[(thread, key)] += int(n)

    def ms_a_s(self, n: int) -> float:
        return 1e3 * n / RATE / self.seconds if self.seconds else 0.0


def mlxq_frame(frames: Sequence[str]) -> str:
    """The innermost frame in mlxq's own code (else the innermost): what of the worker's
    own work a sample was in."""
    ours = [f for f in frames if "/mlxq/" in f]
    f = (ours or list(frames) or ["?"])[-1]
    m = FRAME.match(f)
    return f"{m.group(1)} ({Path(m.group(2)).name})" if m else f


def innermost(frames: Sequence[str]) -> str:
    """The innermost named frame (an unnamed address says nothing), and the innermost of
    MLX's own below it: what the thread was doing, and for which of MLX's steps."""
    names = [f for f in frames if not f.startswith("0x")] or ["?"]
    mlx = [f for f in names if f.startswith("mlx::")]
    key = _short(names[-1])
    if mlx and mlx[-1] != names[-1]:
        key += f" < {_short(mlx[-1])}"
    return key


def _short(frame: str) -> str:
    m = re.fullmatch(r"(.*) \(([^)]*)\)", frame)
    return f"{m.group(1)[:80]} ({Path(m.group(2)).name.split(':')[0]})" if m else frame[:100]


def read(folder: Path) -> dict[bool, Held]:
    """Every window's file in ``folder``, on and off apart."""
    held = {False: Held(), True: Held()}
    for path in sorted(folder.glob("gil-*.txt")):
        if m := re.fullmatch(r"gil-\d+-(on|off)-(\d+)s", path.stem):
            held[m.group(1) == "on"].add(path, float(m.group(2)))
    return held


WHAT = {
    False: "the interpreter's lock, ms a second held (py-spy --gil",
    True: "the threads running, ms a second (py-spy --native",
}


def table(held: dict[bool, Held], frames: int = 12) -> str:
    """The lock's ms a second by thread, off and on windows; then the frames whose share
    grew most in the on windows."""
    off, on = held[False], held[True]
    out = [
        f"{WHAT[native()]}; {off.seconds:.0f} s off, {on.seconds:.0f} s on)",
        "| thread | off | on | on - off |",
        "|---|---|---|---|",
    ]
    names = sorted(set(off.threads) | set(on.threads), key=lambda t: -on.threads[t])
    for t in names:
        a, b = off.ms_a_s(off.threads[t]), on.ms_a_s(on.threads[t])
        out.append(f"| {t} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    a, b = off.ms_a_s(sum(off.threads.values())), on.ms_a_s(sum(on.threads.values()))
    out.append(f"| all | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    grew = {k: on.ms_a_s(on.frames[k]) - off.ms_a_s(off.frames[k]) for k in on.frames}
    out += _frames(
        held,
        "frames (mlxq's innermost) whose share grew most, ms a second on - off",
        sorted(grew, key=lambda k: -grew[k])[:frames],
    )
    if native():  # where the threads spend their time at all, not only what grew
        top = [k for k, _ in off.frames.most_common(frames)]
        out += _frames(held, "frames taking the most, ms a second (off windows)", top)
    return "\n".join(out)


def _frames(held: dict[bool, Held], title: str, keys: Sequence[tuple[str, str]]) -> list[str]:
    """A table of (thread, frame) ``keys``, each with its ms a second off and on."""
    off, on = held[False], held[True]
    out = ["", title, "| thread | frame | off | on |", "|---|---|---|---|"]
    for k in keys:
        out.append(
            f"| {k[0]} | {k[1]} | {off.ms_a_s(off.frames[k]):.1f} | {on.ms_a_s(on.frames[k]):.1f} |"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("folder", type=Path, help="bench_priority --gil's folder")
    ap.add_argument("--frames", type=int, default=12, help="frames listed (12)")
    args = ap.parse_args(argv)
    print(table(read(args.folder), args.frames))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
