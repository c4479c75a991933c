"""How often is a seeded job's whole output identical alone and batched?

A seeded row's sampling noise depends only on (seed, position, token), so any
difference comes from the logits: batched matmuls may round differently from a
batch of one. This runs each seeded job alone, then all of them together among
unseeded rows with other params, and counts identical outputs.

    python ops/seeded_identity.py [--model PATH] [--jobs 32] [--batch 64] [--tokens 64]
"""

from __future__ import annotations

import argparse
import tempfile

from mlxq.producer.params import GenerationRequest, SamplingParams
from mlxq.worker.engine import Engine
from mlxq.worker.jobs import Job, apply_deltas


def run(engine: Engine, jobs: dict[str, GenerationRequest]) -> dict[str, list[int]]:
    records = [Job(j, req, engine.encode(req)) for j, req in jobs.items()]
    for job in records:
        job.start("exec")
    engine.add(records)
    while engine.active:
        apply_deltas(engine.step())
    return {job.id: job.token_ids for job in records}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="mlx-lm model path (default: a fresh tiny model)")
    ap.add_argument("--jobs", type=int, default=32, help="seeded jobs")
    ap.add_argument("--batch", type=int, default=64, help="batch they run in together")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from mlx_lm import load

    path = args.model
    if path is None:
        from mlxq.worker.tiny import build_tiny_model

        path = str(build_tiny_model(tempfile.mkdtemp(prefix="mlxq-tiny-")))
    model, tok = load(path)[:2]
    groups = [
        SamplingParams(0.7, 0.9),
        SamplingParams(1.0, top_k=20),
        SamplingParams(1.2, min_p=0.1),
        SamplingParams(),
    ]
    seeded = {
        f"s{i}": GenerationRequest(
            prompt=f"Seeded story number {i}:",
            max_tokens=args.tokens,
            sampling=SamplingParams(0.8, 0.95, seed=1000 + i),
        )
        for i in range(args.jobs)
    }
    fillers = {
        f"f{i}": GenerationRequest(
            prompt=f"Filler {i}", max_tokens=args.tokens, sampling=groups[i % len(groups)]
        )
        for i in range(max(0, args.batch - args.jobs))
    }
    alone = {j: run(Engine(model, tok, max_batch=1), {j: r})[j] for j, r in seeded.items()}
    together = run(Engine(model, tok, max_batch=args.batch), {**seeded, **fillers})
    same = sum(alone[j] == together[j] for j in seeded)
    first_diff = [
        next(
            (k for k, (a, b) in enumerate(zip(alone[j], together[j], strict=False)) if a != b), None
        )
        for j in seeded
        if alone[j] != together[j]
    ]
    print(
        f"model {path}: {same}/{len(seeded)} seeded jobs identical alone vs in a batch of "
        f"{args.batch} ({args.tokens} tokens each)"
    )
    if first_diff:
        print(f"first differing position of the others: {sorted(first_diff)}")


if __name__ == "__main__":
    main()
