"""A chat row's cost to a sweep's decode steps, through the worker's own engine.

In the worker on an H100 (docs/benchmarks.md, "Which thread holds the interpreter's
lock"), a decode step with a chat job's sampled row in it took 0.25-0.67 ms longer than a
greedy step of the same windows, in the host's parts of the step; ``bench_step_mix
--pipelined``, which builds the same model pass and calls the same sampler in a loop of its
own, found 0.1 ms at most. This times ``Engine.step`` (mlx-lm's batch, the worker's bound
sampler, its detokenizers and deltas), with no Redis and no helper thread, in rounds:

  greedy   ``--rows`` greedy jobs (a sweep's batch)
  chat     the same, with one chat job beside them (seeded, temperature 0.7)
  wider    the same, with one more greedy job instead (the row count alone)
  unseeded (``--phases``) the chat job with no seed: MLX's random noise, not the seeded
           row's keys and hash
  dead     (``--phases``) the greedy jobs and a dead slot: one more joined and left
           (``MLXQ_KV_SLOTS=1``: rows keep their place, :mod:`mlxq.worker.kv_slots`)
  chat-dead (``--phases``) the chat job beside them, and a dead slot

Each phase steps ``--settle`` times untimed after its row joined or left, then times
``--steps`` steps; dead slots are gathered between phases. Steps of a phase where a row
ended (an end of sequence) are left out. ``--after`` times the settle steps too, one by
one: what the first steps after a row joined or left cost over the steady ones.
With ``MLXQ_TRACE_STAGES=FILE`` set, it also prints each phase's decode step parts (the
model pass's graph, the sampler's, the launch, the wait for the last step's tokens: see
``mlxq.worker.stages``), ms at the mean over its timed steps: the host's share apart.
``--nodes`` prints each phase's graph of one step (what its launch evaluates) by primitive:
on a GPU each node but a view is a launch of the host's.

    python ops/bench_engine_steps.py --shape 0.5b             # a GPU: the worker's 0.5B shape
    python ops/bench_engine_steps.py --model DIR --rows 62    # any mlx-lm model
    python ops/bench_engine_steps.py --steps 20 --rounds 2    # the tiny model: a CPU's look
    python ops/bench_engine_steps.py --shape 0.5b --after --rounds 20  # the steps after a join
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from procs import MLXQ

from mlxq.producer.params import GenerationRequest, SamplingParams
from mlxq.worker.engine import Engine
from mlxq.worker.jobs import Job, apply_deltas
from mlxq.worker.stages import TRACE_ENV

PHASES = ("greedy", "chat", "wider")
_CHAT = {"temperature": 0.7}
#: Each phase's extra rows' sampling params in round r.
EXTRA: dict[str, Callable[[int], list[dict[str, float]]]] = {
    "chat": lambda r: [{**_CHAT, "seed": r}],
    "unseeded": lambda r: [_CHAT],
    "wider": lambda r: [{"temperature": 0.0}],
    "dead": lambda r: [{"temperature": 0.0}],
    "chat-dead": lambda r: [{**_CHAT, "seed": r}, {"temperature": 0.0}],
}
#: Of a phase's extra rows, how many (the last) leave before its timed steps: where rows
#: keep their place (kv_slots), theirs stay dead slots through them.
DEAD = {"dead": 1, "chat-dead": 1}


def job(engine: Engine, name: str, tokens: int, **sampling: object) -> Job:
    req = GenerationRequest(
        prompt=f"{name}: the harbour at dawn, the boats, the gulls and the tide",
        max_tokens=tokens,
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
    )
    j = Job(name, req, engine.encode(req))
    j.start("exec")
    return j


def settle(engine: Engine, n: int, key: str, after: After | None, windows: Windows) -> None:
    """``n`` steps after a change; with ``after``, each one's milliseconds under ``key``
    by its place (first, second, ...), and the first two's and the last's spans in
    ``windows`` as ``key #place``."""
    for i in range(n):
        start = time.perf_counter()
        apply_deltas(engine.step())
        if after is not None:
            end = time.perf_counter()
            after.setdefault(key, [[] for _ in range(n)])[i].append((end - start) * 1e3)
            if i in (0, 1, n - 1):  # the parts of the first two and the last
                windows.setdefault(f"{key} #{i + 1}", []).append((start, end))


def steps_ms(engine: Engine, n: int) -> list[float]:
    """``n`` engine steps, each one's wall milliseconds; none if a row ended among them."""
    out, before = [], engine.active
    for _ in range(n):
        start = time.perf_counter()
        apply_deltas(engine.step())
        out.append((time.perf_counter() - start) * 1e3)
    return out if engine.active == before else []


@contextmanager
def launches(graphs: list[str]) -> Iterator[None]:
    """While open, each ``mx.async_eval`` call's graph, as ``mx.export_to_dot`` writes it,
    goes to ``graphs`` (the decode step's launch is the largest of a step's calls)."""
    launch = mx.async_eval

    def spy(*arrays: mx.array) -> None:
        out = io.StringIO()
        mx.export_to_dot(out, *arrays)
        graphs.append(out.getvalue())
        launch(*arrays)

    mx.async_eval = spy
    try:
        yield
    finally:
        mx.async_eval = launch


def nodes(dot: str) -> Counter[str]:
    """A graph's nodes by primitive (a compiled kernel as ``Compiled``)."""
    names = re.findall(r'label ="([A-Za-z0-9_]+)', dot)
    return Counter("Compiled" if n.startswith("Compiled") else n for n in names)


#: Each phase's timed windows (perf_counter start, end): the trace's parts are read in them.
Windows = dict[str, list[tuple[float, float]]]
#: ``--after``: each "phase join" / "phase leave", the milliseconds of its settle steps by
#: place, over rounds.
After = dict[str, list[list[float]]]


def run(
    args: argparse.Namespace,
    model: str,
    windows: Windows,
    graphs: dict[str, Counter[str]],
    after: After | None = None,
) -> dict[str, list[float | None]]:
    engine = Engine.load(model, max_batch=args.rows + 2, prompt_cache_bytes=0)
    print("decode pass:", engine.fused.describe() if engine.fused else "mlx-lm's own call")
    per_round = (len(args.phases) + 1) * (args.settle + args.steps)
    budget = args.rounds * per_round + args.settle + 64
    sweep = [job(engine, f"sweep {i}", budget, temperature=0.0) for i in range(args.rows)]
    engine.add(sweep)
    for _ in range(args.settle):
        apply_deltas(engine.step())
    got: dict[str, list[float | None]] = {p: [] for p in args.phases}
    slots: dict[str, str] = {}
    for r in range(args.rounds):
        for phase in args.phases:
            extra = [
                job(engine, f"{phase} {r} {k}", budget, **params)
                for k, params in enumerate(EXTRA[phase](r) if phase in EXTRA else [])
            ]
            if extra:
                engine.add(extra)
            settle(engine, args.settle, f"{phase} join", after if extra else None, windows)
            if gone := extra[len(extra) - DEAD.get(phase, 0) :]:
                engine.remove(gone)
                extra = extra[: len(extra) - len(gone)]
                settle(engine, args.settle, f"{phase} leave", after, windows)
            slots.setdefault(phase, _slots(engine))
            if args.nodes and phase not in graphs:
                seen: list[str] = []
                with launches(seen):
                    apply_deltas(engine.step())
                graphs[phase] = nodes(max(seen, key=len)) if seen else Counter()
            start = time.perf_counter()
            times = steps_ms(engine, args.steps)
            got[phase].append(statistics.median(times) if times else None)
            if times:
                windows.setdefault(phase, []).append((start, time.perf_counter()))
            if extra:
                engine.remove(extra)
                settle(engine, args.settle, f"{phase} leave", after, windows)
            _gather_dead(engine)
        print(
            f"round {r + 1}: " + ", ".join(f"{p} {_ms(got[p][-1])}" for p in args.phases),
            flush=True,
        )
    print("rows (slots) timed: " + ", ".join(f"{p} {v}" for p, v in slots.items()))
    engine.counters.stages.close()  # its trace, written out for :func:`parts`
    return got


def _batch(engine: Engine) -> Any:
    return engine._gen._generation_batch  # the running batch (a benchmark's look inside)


def _slots(engine: Engine) -> str:
    """The running batch's rows, and its slots where some are dead."""
    batch = _batch(engine)
    rows = len(batch.uids)
    width = batch.slots.width(rows)
    return f"{rows}" if width == rows else f"{rows} ({width})"


def _gather_dead(engine: Engine) -> None:
    """Gather the running batch's live slots (a dead slot left by a phase is not the next
    phase's): what a batch does once its dead slots wait past ``IDLE_STEPS``."""
    batch = _batch(engine)
    if batch.slots.free:
        batch.slots.drop_dead(batch.prompt_cache, [len(t) for t in batch.tokens])


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def report(got: dict[str, list[float | None]], rows: int) -> str:
    """Each phase's median of rounds, and what it costs over the greedy phase at the same
    context. The rows' context grows through a run, and a step's time with it, so a
    phase's steps are set against the greedy steps of its round and the next, weighed by
    where it ran between them (the last round has no next: left out of the cost)."""
    greedy = got.get("greedy", [])
    names = list(got)
    lines = [
        f"engine steps, ms at the median of each phase; median of rounds ({rows} rows); "
        "cost over greedy at the same context"
    ]
    for p in names:
        values = [x for x in got[p] if x is not None]
        if not values:
            lines.append(f"  {p:<8} -")
            continue
        over = ""
        if p != "greedy":
            at = names.index(p) / len(names)
            costs = [
                x - (a + (b - a) * at)
                for x, a, b in zip(got[p], greedy, greedy[1:], strict=False)
                if x is not None and a is not None and b is not None
            ]
            if costs:
                over = f"  ({statistics.median(costs):+.2f} over greedy)"
        rounds = " ".join(_ms(x) for x in got[p])
        lines.append(f"  {p:<8} {statistics.median(values):.2f}{over}   rounds: {rounds}")
    return "\n".join(lines)


def report_after(after: After) -> str:
    """``--after``: each join's and leave's settle steps, ms at the median by place."""
    lines = ["steps after a row joined or left, ms at the median of rounds, by place"]
    for key, places in after.items():
        lines.append(f"  {key:<16} " + " ".join(_ms(_median(x)) for x in places))
    return "\n".join(lines)


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def parts(trace: Path, windows: Windows, steps: int) -> str:
    """Each phase's decode step parts from the stage trace, ms a step at the mean (a
    window named "... #place" is one step: ``--after``'s)."""
    lines = [json.loads(x) for x in trace.read_text().splitlines() if x.strip()]
    names = ("graph", "sample", "launch", "wait")
    out = ["decode step parts, ms a step at the mean (the stage trace)"]
    out.append(f"  {'phase':<16} " + " ".join(f"{n:>7}" for n in names))
    for phase, spans in windows.items():
        ms = dict.fromkeys(names, 0.0)
        for x in lines:
            if x.get("part") and x["stage"] in ms and any(a <= x["t"] < b for a, b in spans):
                ms[x["stage"]] += x["ms"]
        n = (1 if "#" in phase else steps) * len(spans)
        out.append(f"  {phase:<16} " + " ".join(f"{ms[k] / n:7.3f}" for k in names))
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", help="mlx-lm model dir or repo id (default: the tiny model)")
    ap.add_argument("--shape", choices=("0.5b", "1.5b", "deep"), help="build a random model of it")
    ap.add_argument("--rows", type=int, default=62, help="the sweep's greedy rows (62)")
    ap.add_argument("--steps", type=int, default=100, help="timed steps a phase (100)")
    ap.add_argument("--settle", type=int, default=8, help="untimed steps after a change (8)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the phases (5)")
    ap.add_argument(
        "--phases",
        type=lambda v: tuple(p for p in v.split(",") if p),
        default=PHASES,
        help=f"comma-separated, run in this order each round (default {','.join(PHASES)}; "
        f"also: {', '.join(k for k in EXTRA if k not in PHASES)})",
    )
    ap.add_argument("--nodes", action="store_true", help="each phase's step graph by primitive")
    ap.add_argument(
        "--after",
        action="store_true",
        help="time the --settle steps after each join and leave one by one",
    )
    args = ap.parse_args(argv)
    bad = [p for p in args.phases if p != "greedy" and p not in EXTRA]
    if bad or "greedy" not in args.phases:
        ap.error(f"--phases {','.join(args.phases)!r}: want greedy and any of {', '.join(EXTRA)}")
    if min(args.rows, args.steps, args.rounds) < 1 or args.settle < 0:
        ap.error("--rows, --steps and --rounds must be >= 1, --settle >= 0")
    with tempfile.TemporaryDirectory() as work:
        model = args.model
        if model is None or (args.shape and not (Path(model) / "config.json").exists()):
            model = model or str(Path(work) / "model")
            if args.shape:
                code = (
                    "import sys; from mlxq.worker.random_model import build_random_model as b; "
                    "b(sys.argv[1], shape=sys.argv[2], eos_reachable=False, dtype=sys.argv[3])"
                )
                # deep: a CPU's look at a real model's count of ops, in float32 (a CPU's
                # bfloat16 products are several times slower)
                dtype = "float32" if args.shape == "deep" else "bfloat16"
                subprocess.run([sys.executable, "-c", code, model, args.shape, dtype], check=True)
            else:
                subprocess.run([str(MLXQ), "model", "tiny", model], check=True, capture_output=True)
        windows: Windows = {}
        graphs: dict[str, Counter[str]] = {}
        after: After | None = {} if args.after else None
        print(report(run(args, model, windows, graphs, after), args.rows))
        if after:
            print(report_after(after))
        for phase, count in graphs.items():
            top = ", ".join(f"{k} {v}" for k, v in count.most_common())
            print(f"{phase} step's graph: {sum(count.values())} nodes: {top}")
        trace = os.environ.get(TRACE_ENV)
        if trace and Path(trace).exists():
            print(parts(Path(trace), windows, args.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
