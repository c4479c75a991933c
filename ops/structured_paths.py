"""Structured outputs' validity through the ways users send them: `mlxq run-batch` and the
official openai client against `mlxq serve`.

``ops/bench_structured.py`` checks the engine's answers in process; this script sends the
same constraints (the JSON schema, the four choices, the regex) through a private Redis, a
real ``mlxq worker`` and ``mlxq serve`` on the tiny random-weight model (or ``--model``),
whose free text is noise, so every valid answer is the constraint's doing:

- run-batch: one JSONL file of ``--answers`` chat requests of each kind (``response_format``
  json_schema, ``structured_outputs`` choice and regex), temperature 1, distinct seeds;
- the openai client (``AsyncOpenAI``, ``--concurrency`` requests in flight): the same
  requests, the choice and regex ones through ``extra_body``.

Prints the percent of answers that parse and validate (``jsonschema``), are one of the
choices, or match the regex whole; exits 1 unless every one does.

Usage:
    python ops/structured_paths.py                 # 2,000 answers of each kind, each path
    python ops/structured_paths.py --answers 200 --model PATH
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
from bench_gateway import raise_fd_limit, start_gateway
from bench_structured import CHOICES, REGEX, SCHEMA, schema_ok
from procs import MLXQ, start_redis, start_worker, stop

QUEUE = "structured-paths"
#: (the body fields of the constraint, max_tokens), by kind.
KINDS: dict[str, tuple[dict[str, Any], int]] = {
    "json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
            }
        },
        128,
    ),
    "choice": ({"structured_outputs": {"choice": CHOICES}}, 8),
    "regex": ({"structured_outputs": {"regex": REGEX}}, 48),
}


CHECKS: dict[str, Callable[[str], bool]] = {
    "json_schema": schema_ok,
    "choice": lambda t: t in CHOICES,
    "regex": lambda t: re.fullmatch(REGEX, t) is not None,
}


def body(kind: str, i: int) -> dict[str, Any]:
    fields, max_tokens = KINDS[kind]
    return {
        "model": QUEUE,
        "messages": [{"role": "user", "content": f"Answer {i}:"}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": i,
        **fields,
    }


def via_run_batch(url: str, n: int, work: Path) -> dict[str, list[str]]:
    """Every request in one run-batch file; each kind's answers."""
    inp, out = work / "in.jsonl", work / "out.jsonl"
    with inp.open("w") as f:
        for kind in KINDS:
            for i in range(n):
                line = {"custom_id": f"{kind}/{i}", "method": "POST", "url": "/v1/chat/completions"}
                f.write(json.dumps({**line, "body": body(kind, i)}) + "\n")
    cmd = [str(MLXQ), "run-batch", "--input", str(inp), "--output", str(out)]
    cmd += ["--queue", QUEUE, "--redis-url", url, "--progress", "off"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"run-batch exited {done.returncode}:\n{done.stderr}")
    answers: dict[str, list[str]] = {kind: [] for kind in KINDS}
    for rec in map(json.loads, out.read_text().splitlines()):
        kind = rec["custom_id"].split("/")[0]
        answers[kind].append(rec["response"]["body"]["choices"][0]["message"]["content"])
    return answers


async def via_openai(base: str, n: int, concurrency: int) -> dict[str, list[str]]:
    """The same requests through the official client, ``concurrency`` at a time."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(kind: str, i: int) -> tuple[str, str]:
        b = body(kind, i)
        extra = {"structured_outputs": b.pop("structured_outputs")} if kind != "json_schema" else {}
        async with gate:
            res = await client.chat.completions.create(**b, extra_body=extra or None)
        return kind, res.choices[0].message.content or ""

    answers: dict[str, list[str]] = {kind: [] for kind in KINDS}
    try:
        for kind, text in await asyncio.gather(*(one(k, i) for k in KINDS for i in range(n))):
            answers[kind].append(text)
    finally:
        await client.close()
    return answers


def report(path: str, answers: dict[str, list[str]], n: int, seconds: float) -> bool:
    print(f"{path} ({seconds:.1f} s):")
    ok = True
    for kind, texts in answers.items():
        valid = sum(CHECKS[kind](t) for t in texts)
        ok &= valid == n == len(texts)
        print(f"  {kind:12s} {100 * valid / n:6.2f}% valid ({valid} of {n}; {len(texts)} answered)")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model path or repo id (default: tiny)")
    ap.add_argument("--answers", type=int, default=2000, help="requests of each kind, each path")
    ap.add_argument("--concurrency", type=int, default=64, help="openai requests in flight")
    ap.add_argument("--max-batch", type=int, default=64)
    args = ap.parse_args()
    raise_fd_limit()
    started: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="mlxq-structured-paths-") as tmp:
        work = Path(tmp)
        try:
            url, server = start_redis(work, ["--maxclients", "10000"])
            started.append(server)
            model = args.model or str(work / "tiny")
            if args.model is None:
                subprocess.run([str(MLXQ), "model", "tiny", model], check=True, capture_output=True)
            extra = ["--max-batch", str(args.max_batch)]
            start_worker(model, url, QUEUE, work / "worker.log", extra, started=started)
            base, _ = start_gateway(url, work, started)
            t0 = time.perf_counter()
            ok = report(
                "run-batch",
                via_run_batch(url, args.answers, work),
                args.answers,
                time.perf_counter() - t0,
            )
            t0 = time.perf_counter()
            got = asyncio.run(via_openai(base, args.answers, args.concurrency))
            ok &= report(
                "openai client via mlxq serve", got, args.answers, time.perf_counter() - t0
            )
        finally:
            for proc in reversed(started):
                stop(proc)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
