"""Read a worker's stage trace (``MLXQ_TRACE_STAGES=FILE``): which passes were slow.

``mlxq info --json``'s ``busy_ms`` says which stage of the decode thread grew; the trace
has each stage as it ended (its start on the thread's clock, its own milliseconds, and
what it noted: a prefill pass's rows, padded width, keys attended and whether that shape
was new to the worker, a decode step's rows). This sums it by stage and splits the prefill
passes by first-seen and seen shapes, over a span of the clock (a benchmark's phase).

    MLXQ_TRACE_STAGES=/tmp/t.jsonl mlxq worker ...
    python ops/stage_trace.py /tmp/t.jsonl [--from T0 --to T1] [--slowest 10]

``ops/bench_priority.py --trace DIR`` sets the variable for each worker it starts and
prints this table for each phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Tally:
    """Passes of one kind: how many, their milliseconds (and, traced with
    ``MLXQ_TRACE_SYNC=1``, how much of those was waiting for the device)."""

    ms: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    #: Of a decode step's part, the milliseconds its thread spent off the CPU (blocked).
    off: list[float] = field(default_factory=list)

    def add(self, x: dict[str, Any]) -> None:
        """One traced line: its milliseconds, its device wait and its time off the CPU
        (a decode step's part), each where the line has it."""
        self.ms.append(x["ms"])
        if "wait_ms" in x:
            self.wait.append(x["wait_ms"])
        if "cpu_ms" in x:
            self.off.append(max(x["ms"] - x["cpu_ms"], 0.0))

    def line(self, name: str) -> str:
        if not self.ms:
            return f"{name:<28} {0:>6}"
        xs = sorted(self.ms)
        p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
        waited = f" {sum(self.wait):>10.1f}" if self.wait else ""
        blocked = ""
        if self.off:
            blocked = f"  off-CPU {sum(self.off):.1f} ({statistics.mean(self.off):.2f})"
        return (
            f"{name:<28} {len(xs):>6} {sum(xs):>10.1f} {statistics.mean(xs):>8.2f} "
            f"{statistics.median(xs):>8.2f} {p99:>8.2f} {xs[-1]:>8.1f}{waited}{blocked}"
        )


def read(path: str | Path, start: float | None = None, end: float | None = None) -> list[dict]:
    """The trace's lines whose stage started within ``[start, end]`` (either open)."""
    out = []
    with open(path) as f:
        for raw in f:
            try:
                line = json.loads(raw)
            except ValueError:
                continue  # a line cut short by a worker's exit
            t = line.get("t", 0.0)
            if (start is None or t >= start) and (end is None or t <= end):
                out.append(line)
    return out


def summary(lines: Sequence[dict[str, Any]], slowest: int = 0) -> str:
    """Per stage (a pass of a shape new to the worker apart): passes, total, mean, p50,
    p99 and most milliseconds; prefill passes of one row and of several; decode steps of
    greedy rows only and with sampled rows, their parts (traced ``"part"`` lines) by the
    same split, and by whether rows joined or left the batch just before them; then the
    slowest prefill passes."""
    tallies: dict[str, Tally] = {}
    prefills: list[dict[str, Any]] = []
    for line in lines:
        stage = line["stage"]
        if line.get("part"):  # inside its decode step's line: tallied with it below
            continue
        if stage == "prefill" and "rows" in line:
            prefills.append(line)
        if line.get("new"):  # the worker's first pass of this shape
            stage = f"{stage}, new shape"
        tallies.setdefault(stage, Tally()).add(line)
    head = f"{'stage':<28} {'passes':>6} {'ms':>10} {'mean':>8} {'p50':>8} {'p99':>8} {'most':>8}"
    if any(t.wait for t in tallies.values()):
        head += f" {'device ms':>10}"
    rows = [head] + [tallies[k].line(k) for k in sorted(tallies)]
    if prefills:
        one = [p["ms"] for p in prefills if p["rows"] == 1]
        many = [p["ms"] for p in prefills if p["rows"] > 1]
        rows.append(Tally(one).line("prefill of one row"))
        rows.append(Tally(many).line("prefill of several rows"))
        shapes = {(p["rows"], p["width"], p["keys"]) for p in prefills}
        rows.append(f"prefill shapes (rows, width, keys): {len(shapes)}")
    steps = [x for x in lines if x["stage"] == "decode" and "sampled" in x and not x.get("new")]
    if steps:  # what sampled rows (an interactive job's) cost a greedy batch's step
        rows.append(Tally([x["ms"] for x in steps if not x["sampled"]]).line("decode, all greedy"))
        rows.append(Tally([x["ms"] for x in steps if x["sampled"]]).line("decode, some sampled"))
    split = _parts(lines) | {f"decode, {k}": t for k, t in _by_row_change(lines).items()}
    rows += [tally.line(name) for name, tally in split.items()]
    rows += _waits(lines)
    rows += _step_kinds(lines)
    rows += _copied_joins(lines)
    rows += _bookkeeping(lines)
    if slowest and prefills:
        rows.append(f"slowest {slowest} prefill passes (rows x width, keys, new, ms):")
        for p in sorted(prefills, key=lambda p: -p["ms"])[:slowest]:
            rows.append(
                f"  {p['rows']} x {p['width']}, {p['keys']}, {bool(p.get('new'))}, {p['ms']:.1f}"
            )
    return "\n".join(rows)


def _steps(
    lines: Sequence[dict[str, Any]],
) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each decode step of a shape seen before, with its traced parts (a part ends before
    its step's line; a first-token pass's parts are its own, not the next step's)."""
    pending: list[dict[str, Any]] = []
    for x in lines:
        if x.get("part"):
            pending.append(x)
        elif x["stage"] in ("decode", "first_token"):
            if x["stage"] == "decode" and "sampled" in x and not x.get("new"):
                yield x, pending
            pending = []


def _parts(lines: Sequence[dict[str, Any]]) -> dict[str, Tally]:
    """Decode steps' parts (the model pass's graph, the sampler's, the launch, the wait for
    the last step: host work or the device's) by whether the step had sampled rows, with
    the time the thread spent off the CPU in them (total, and mean a part) where the trace
    has it."""
    out: dict[str, Tally] = {}
    for x, parts in _steps(lines):
        kind = "some sampled" if x["sampled"] else "all greedy"
        for p in parts:
            out.setdefault(f"  {kind}: {p['stage']}", Tally()).add(p)
    return dict(sorted(out.items()))


def _waits(lines: Sequence[dict[str, Any]], least: int = 20) -> list[str]:
    """How long decode steps waited for the device (their ``wait`` part: the last step's
    tokens), by rows and sampled rows, for each such batch of at least ``least`` steps.
    The host builds a step while the device runs the last one, so a wait says the device
    took longer than the host: e.g. a 65th row, which doubles every 4-bit product's tiles
    on MLX's CUDA backend."""
    got: dict[tuple[int, int], list[float]] = {}
    for x, parts in _steps(lines):
        for p in parts:
            if p["stage"] == "wait" and "rows" in x:
                got.setdefault((x["rows"], min(x["sampled"], 1)), []).append(p["ms"])
    out = []
    for (n, sampled), w in sorted(got.items()):
        if len(w) >= least:
            over = sum(v > 1.0 for v in w) / len(w)
            out.append(
                f"decode, {n} rows, {'some' if sampled else 'none'} sampled: {len(w)} steps "
                f"waited {statistics.mean(w):.2f} ms for the device at the mean, "
                f"over 1 ms in {over:.0%}"
            )
    return out


def _step_kinds(lines: Sequence[dict[str, Any]], least: int = 20) -> list[str]:
    """Decode steps by kind, for each kind of at least ``least`` steps: what changed the
    batch just before (nothing, a join, a leave, both), its rows, sampled rows and slots
    (rows plus the places rows left, ``mlxq.worker.kv_slots``); each kind's step and its
    parts (the graph, the launch, the wait for the device) at p50, and the step's p50 over
    the most common kind's. A step after a change that costs more than a steady step of
    the same rows says what the change left the step to pay."""
    parts: dict[int, list[dict[str, Any]]] = {}
    for x, ps in _steps(lines):
        parts[id(x)] = ps
    kinds: dict[tuple[str, int, int, int], list[dict[str, Any]]] = {}
    for x, changed in _with_changes(lines):
        if id(x) not in parts or "rows" not in x:
            continue
        change = "+".join(sorted(c.removeprefix("rows_") for c in changed)) or "steady"
        key = (change, x["rows"], min(x["sampled"], 1), x.get("slots", x["rows"]))
        kinds.setdefault(key, []).append(x)
    kinds = {k: v for k, v in kinds.items() if len(v) >= least}
    if not kinds:
        return []
    base = statistics.median(x["ms"] for x in max(kinds.values(), key=len))

    def p50(steps: list[dict[str, Any]], part: str) -> float:
        got = [p["ms"] for x in steps for p in parts[id(x)] if p["stage"] == part]
        return statistics.median(got) if got else 0.0

    out = [
        f"{'decode steps by kind':<34} {'steps':>6} {'p50':>7} {'over':>7} {'graph':>7} "
        f"{'launch':>7} {'wait':>7}"
    ]
    for (change, n, sampled, slots), steps in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        ms = statistics.median(x["ms"] for x in steps)
        name = f"{change}, {n} rows{' (' + str(slots) + ' slots)' if slots != n else ''}"
        name += ", sampled" if sampled else ""
        out.append(
            f"  {name:<32} {len(steps):>6} {ms:>7.2f} {ms - base:>+7.2f} "
            f"{p50(steps, 'graph'):>7.2f} {p50(steps, 'launch'):>7.2f} {p50(steps, 'wait'):>7.2f}"
        )
    return out


def _copied_joins(lines: Sequence[dict[str, Any]]) -> list[str]:
    """Joins that copied every row's KV (mlx-lm's concatenation) where rows keep their
    place, by why they could not join in place (``Slots.refused``): their passes, rows,
    and the join stage's ms at p50."""
    why: dict[str, list[dict[str, Any]]] = {}
    for x in lines:
        if x["stage"] == "rows_join" and "copy" in x:
            why.setdefault(x["copy"] or "?", []).append(x)
    if not why:
        return []
    out = ["joins by a copy, by why not in place: passes, rows, join ms at p50"]
    for reason, xs in sorted(why.items(), key=lambda kv: -len(kv[1])):
        rows = sum(int(x.get("rows", 0)) for x in xs)
        ms = statistics.median(x["ms"] for x in xs)
        out.append(f"  {reason:<32} {len(xs):>6} {rows:>6} {ms:>7.2f}")
    return out


#: What an engine step did, by the stages traced inside its ``step_other`` (a prefill
#: pass by its rows), as :func:`_bookkeeping` names it.
_DID = {"decode": "decode", "first_token": "first", "rows_join": "join", "rows_leave": "leave"}


def _bookkeeping(lines: Sequence[dict[str, Any]]) -> list[str]:
    """mlx-lm's own work around an engine step's passes (``step_other``: making the
    prompt batch, handing its rows over, building the batch's responses) by what else the
    step did: a decode step, a refill (a prefill of several rows), one row's prefill, a
    first-token pass, rows joining or leaving. On an H100 a refill's came to 26-30 ms with
    MLX's buffer cache kept, 5 cleared (docs/benchmarks.md). A step's stages end, and are
    traced, before its ``step_other`` line."""
    kinds: dict[str, Tally] = {}
    did: set[str] = set()
    for x in lines:
        stage = x["stage"]
        if x.get("part"):
            continue
        if stage == "step_other":
            kinds.setdefault("+".join(sorted(did)) or "nothing else", Tally()).add(x)
            did = set()
        elif stage == "prefill" and "rows" in x:
            did.add("refill" if x["rows"] > 1 else "prefill 1")
        elif stage in _DID:
            did.add(_DID[stage])
    if len(kinds) < 2:
        return []
    out = ["step_other by what else its step did"]
    for name, tally in sorted(kinds.items(), key=lambda kv: -sum(kv[1].ms)):
        out.append(tally.line(f"  {name}"))
    return out


def _with_changes(lines: Sequence[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], set[str]]]:
    """Each line with the row changes (``rows_join``, ``rows_leave``) since the last
    decode step ended: for a decode step's line, what changed the batch just before it.
    Lines are in the order the stages ended."""
    changed: set[str] = set()
    for x in lines:
        if x["stage"] in ("rows_join", "rows_leave"):
            changed.add(x["stage"])
        yield x, changed
        if x["stage"] == "decode":
            changed = set()


def _by_row_change(lines: Sequence[dict[str, Any]]) -> dict[str, Tally]:
    """Decode steps (of shapes seen before) by what changed the batch since the last one:
    rows left (a leave filters every layer's KV cache), rows joined (an extend), or
    nothing."""
    out = {k: Tally() for k in ("rows unchanged", "after a join", "after a leave")}
    for x, changed in _with_changes(lines):
        if x["stage"] == "decode" and "sampled" in x and not x.get("new"):
            key = (
                "after a leave"
                if "rows_leave" in changed
                else "after a join"
                if changed
                else "rows unchanged"
            )
            out[key].add(x)
    return out if out["after a join"].ms or out["after a leave"].ms else {}


def _kinds(lines: Sequence[dict[str, Any]]) -> tuple[dict[str, float], dict[str, list[float]], int]:
    """Each stage's milliseconds, decode steps split by kind (greedy, sampled, just after
    rows joined or left or of a new shape) with their own milliseconds, and the steps."""
    ms: dict[str, float] = {}
    steps: dict[str, list[float]] = {}
    for x, changed in _with_changes(lines):
        if x.get("part"):
            continue
        stage = x["stage"]
        if stage == "decode":
            kind = "sampled" if x.get("sampled") else "greedy"
            kind = "after a row change" if changed or x.get("new") else kind
            steps.setdefault(kind, []).append(x["ms"])
            stage = f"decode, {kind}"
        elif stage == "prefill" and "rows" in x:
            stage = "prefill of one row" if x["rows"] == 1 else "prefill of several rows"
        ms[stage] = ms.get(stage, 0.0) + x["ms"]
    return ms, steps, sum(len(v) for v in steps.values())


def budget(
    base: Sequence[dict[str, Any]], base_s: float, other: Sequence[dict[str, Any]], other_s: float
) -> str:
    """Where a pass of ``other`` (e.g. windows with interactive jobs) went over one of
    ``base`` (the windows without, same worker): each stage's milliseconds per decode step
    in both, and the difference; then the decode steps by kind, each kind's mean and what
    its steps cost over ``base``'s greedy step, per step of ``other``. Spans of
    ``base_s`` and ``other_s`` seconds."""
    (ms0, kinds0, n0), (ms1, kinds1, n1) = _kinds(base), _kinds(other)
    if not n0 or not n1:
        return "budget: no decode steps in one of the spans"
    rows = [f"{'per decode step, ms':<34} {'off':>7} {'on':>7} {'on-off':>7}"]
    for stage in sorted(
        set(ms0) | set(ms1), key=lambda k: -(ms0.get(k, 0) / n0 + ms1.get(k, 0) / n1)
    ):
        a, b = ms0.get(stage, 0.0) / n0, ms1.get(stage, 0.0) / n1
        if max(a, b) >= 0.005:
            rows.append(f"{stage:<34} {a:>7.2f} {b:>7.2f} {b - a:>+7.2f}")
    a, b = 1e3 * base_s / n0, 1e3 * other_s / n1
    rows.append(f"{'the wall clock':<34} {a:>7.2f} {b:>7.2f} {b - a:>+7.2f}")
    rows.append(f"steps a second: {n0 / base_s:.1f} off, {n1 / other_s:.1f} on ({a / b:.3f})")
    greedy = statistics.mean(kinds0.get("greedy") or [0.0])
    for kind, xs in sorted(kinds1.items()):
        over = (statistics.mean(xs) - greedy) * len(xs) / n1
        rows.append(
            f"  on, {kind}: {len(xs)} steps, mean {statistics.mean(xs):.2f} ms "
            f"({over:+.2f} ms a step over the off windows' greedy {greedy:.2f})"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("trace", help="a file a worker wrote under MLXQ_TRACE_STAGES")
    ap.add_argument("--from", dest="start", type=float, help="from this clock time (s)")
    ap.add_argument("--to", dest="end", type=float, help="to this clock time (s)")
    ap.add_argument("--slowest", type=int, default=10, help="list this many prefill passes")
    args = ap.parse_args(argv)
    print(summary(read(args.trace, args.start, args.end), args.slowest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
