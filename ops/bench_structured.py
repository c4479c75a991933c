"""Structured outputs on the engine: how often answers hold their shape, and what masks cost.

Runs the worker's engine in process (no Redis) on the tiny random-weight model (or
``--model``), whose free text is noise, so every valid answer is the constraint's doing.

Validity: ``--answers`` jobs each of a JSON schema (parsed and checked with
``jsonschema``), a choice (one of the strings) and a regex (matched whole), sampled at
temperature 1 with distinct seeds; prints the percent valid.

Cost, side by side in one run, rounds interleaved, best of ``--rounds`` (ratios of
tokens per second, of wall time and of this process's CPU time, which other work on a
shared machine disturbs less; 1.0 means the constraint costs nothing):

  schema-all   every row of a ``--batch`` batch under one shared JSON schema (a long
               string field, so no row ends before ``--tokens``) vs no constraint
  schema-25%   a quarter of the rows under it vs none
  choice sweep ``--sweep`` questions answered from four letters (jobs per second) vs the
               same questions unconstrained, capped at the same two tokens
  fill         the mask stage alone, no forward pass beside it: ``--batch`` rows of the
               long schema advanced one token and their masks filled (ms a step)

Usage:
    python ops/bench_structured.py                  # tiny model, batch 64, 64 tokens
    python ops/bench_structured.py --model PATH --answers 500 --sweep 500
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence

import jsonschema
import mlx.core as mx
import mlx_lm

from mlxq.batching.grammar import GrammarRows
from mlxq.producer.client import build_request
from mlxq.producer.params import GenerationRequest
from mlxq.worker.engine import Engine
from mlxq.worker.jobs import Job, apply_deltas
from mlxq.worker.tiny import build_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
#: No row ends before the step budget: its one string is long.
LONG_SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "string", "minLength": 400, "maxLength": 600}},
    "required": ["notes"],
}
CHOICES = ["A", "B", "C", "D"]
REGEX = r"[0-9]{3}-[0-9]{4} [a-z]{2,8}"


def schema_ok(text: str) -> bool:
    """Whether an answer parses as JSON and validates against :data:`SCHEMA`."""
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def drive(engine: Engine, reqs: Sequence[GenerationRequest]) -> tuple[list[Job], float]:
    """Run every request to its end, filling the batch as rows free; (jobs, seconds)."""
    waiting = deque(reqs)
    done: list[Job] = []
    start = time.perf_counter()
    while waiting or engine.active:
        batch = []
        while waiting and len(batch) < engine.free_slots:
            req = waiting.popleft()
            job = Job(f"j{len(done)}", req, engine.encode(req))
            job.start("bench")
            batch.append(job)
            done.append(job)
        engine.add(batch)
        apply_deltas(engine.step())
    return done, time.perf_counter() - start


def validity(engine: Engine, n: int) -> None:
    def share(kw: dict[str, object], tokens: int, ok: Callable[[str], bool]) -> float:
        reqs = [
            build_request(f"Answer {i}:", max_tokens=tokens, temperature=1.0, seed=i, **kw)  # type: ignore[arg-type]
            for i in range(n)
        ]
        jobs, _ = drive(engine, reqs)
        return 100 * sum(ok("".join(j.choices[0].text)) for j in jobs) / n

    print(f"validity over {n} answers each (temperature 1, distinct seeds):")
    print(f"  json_schema  {share({'json_schema': SCHEMA}, 128, schema_ok):6.2f}% valid")
    print(f"  choice       {share({'choice': CHOICES}, 8, lambda t: t in CHOICES):6.2f}% valid")
    rx = share({"regex": REGEX}, 48, lambda t: re.fullmatch(REGEX, t) is not None)
    print(f"  regex        {rx:6.2f}% valid")


def timed(engine: Engine, reqs: list[GenerationRequest], per_job: bool) -> tuple[float, float]:
    """Tokens (or, ``per_job``, jobs) per wall second and per CPU second of this process."""
    cpu = time.process_time()
    jobs, wall = drive(engine, reqs)
    cpu = time.process_time() - cpu
    n = len(jobs) if per_job else sum(len(j.choices[0].token_ids) for j in jobs)
    return n / wall, n / cpu


def cost(engine: Engine, batch: int, tokens: int, sweep: int, rounds: int) -> None:
    def rows(constrained: int) -> list[GenerationRequest]:
        return [
            build_request(
                f"Row {i}:",
                max_tokens=tokens,
                temperature=1.0,
                seed=i,
                **({"json_schema": LONG_SCHEMA} if i < constrained else {}),  # type: ignore[arg-type]
            )
            for i in range(batch)
        ]

    def questions(constrained: bool) -> list[GenerationRequest]:
        kw: dict[str, object] = {"choice": CHOICES} if constrained else {}
        return [build_request(f"Question {i}? Answer:", max_tokens=2, **kw) for i in range(sweep)]  # type: ignore[arg-type]

    cases = {
        "unconstrained": lambda: timed(engine, rows(0), False),
        "schema-all": lambda: timed(engine, rows(batch), False),
        "schema-25%": lambda: timed(engine, rows(batch // 4), False),
        "sweep-free": lambda: timed(engine, questions(False), True),
        "sweep-choice": lambda: timed(engine, questions(True), True),
    }
    for run in cases.values():  # a round untimed: every shape compiled, every cache warm
        run()
    best = {name: (0.0, 0.0) for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            wall, cpu = run()
            best[name] = (max(best[name][0], wall), max(best[name][1], cpu))
    print(f"cost, batch {batch}, {tokens} tokens, best of {rounds} (interleaved);")
    print("  per wall second, and per CPU second of this process (steadier on a shared machine):")
    for name, base in (
        ("unconstrained", "unconstrained"),
        ("schema-all", "unconstrained"),
        ("schema-25%", "unconstrained"),
        ("sweep-free", "sweep-free"),
        ("sweep-choice", "sweep-free"),
    ):
        (w, c), (bw, bc) = best[name], best[base]
        unit = "jobs" if name.startswith("sweep") else "tok"
        print(
            f"  {name:<14} {w:8.1f} {unit}/s ratio {w / bw:.3f}   "
            f"{c:8.1f} {unit}/cpu-s ratio {c / bc:.3f}"
        )
    c = engine.counters
    print(
        f"  vectorized_steps == decode_steps: {c.vectorized_steps == c.decode_steps}"
        f" ({c.decode_steps} steps); mask fill {c.mask_ms:.0f} ms over the run;"
        f" constraints compiled: {c.constraint_compiles}"
    )


def fill(engine: Engine, batch: int, steps: int = 200) -> None:
    """The mask stage alone: every row inside the long schema's string, one token a step."""
    constraint = build_request("x", json_schema=LONG_SCHEMA).constraint
    assert constraint is not None
    rows = [engine.grammars.row(constraint) for _ in range(batch)]
    start = engine.tokenizer.encode('{"notes":"', add_special_tokens=False)
    for r in rows:
        r.fresh = False
        for t in start:
            r.feed(t)
    letter = engine.tokenizer.encode("a", add_special_tokens=False)[-1]
    grammar = GrammarRows.bind(rows, engine.vocab_size)
    assert grammar is not None
    grammar.masks([letter] * batch)
    t0 = time.perf_counter()
    for _ in range(steps):
        mx.eval(grammar.masks([letter] * batch))
    ms = (time.perf_counter() - t0) * 1000 / steps
    print(f"  fill alone, {batch} rows mid-string: {ms:.3f} ms a step (advance + fill + copy)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="an mlx-lm model path (default: the tiny random model)")
    ap.add_argument("--batch", type=int, default=64, help="rows (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens a row (default: %(default)s)")
    ap.add_argument(
        "--answers",
        type=int,
        default=2000,
        help="validity jobs (default: %(default)s; 0: cost only)",
    )
    ap.add_argument(
        "--sweep", type=int, default=2000, help="choice questions (default: %(default)s)"
    )
    ap.add_argument("--rounds", type=int, default=3, help="best of N (default: %(default)s)")
    args = ap.parse_args()
    path = args.model or str(build_tiny_model(tempfile.mkdtemp(prefix="mlxq-tiny-"), seed=0))
    model, tok = mlx_lm.load(path)
    engine = Engine(model, tok, max_batch=args.batch)
    if args.answers > 0:
        validity(engine, args.answers)
    cost(engine, args.batch, args.tokens, args.sweep, args.rounds)
    fill(engine, args.batch)


if __name__ == "__main__":
    main()
