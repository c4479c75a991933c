"""Pool the sweep's share over the windows of several ``bench_priority.py --parts turns``
runs: one window's ratio spreads far wider than the gap between a share and its floor, so
one run of four windows settles nothing, and runs on one card can be pooled.

    python ops/pool_turns.py out/priority-turns-*.json
    python ops/pool_turns.py compiled=out/*-c1.json plain=out/*-c0.json

Each argument is a JSON file or glob, optionally ``label=`` in front: files of one label
are pooled together (the default label is "all"). Per label it prints the windows' median
and mean, each run's floor (0.95 of the sweep's rate less the chat rows' share), the
spread of one window, and a bootstrap interval of the mean and of the median (resampling
windows). Two labels are compared by the bootstrap interval of the difference of their
means.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_priority import Turn, turns_floor

DRAWS = 5000


def floor(doc: dict[str, Any]) -> float | None:
    """A run's floor (bench_priority's, from its on windows' tokens); None without any."""
    turns = [Turn(**{k: t[k] for k in ("on", "sweep", "chat", "seconds")}) for t in doc["turns"]]
    return turns_floor(turns) if any(t.on and t.chat + t.sweep for t in turns) else None


def interval(
    rng: random.Random, stat: Callable[..., float], *samples: Sequence[float]
) -> tuple[float, float]:
    """The 5th and 95th percentiles of ``stat`` over :data:`DRAWS` bootstrap resamples
    of ``samples`` (each resampled apart)."""
    draws = sorted(stat(*(rng.choices(x, k=len(x)) for x in samples)) for _ in range(DRAWS))
    return draws[int(0.05 * DRAWS)], draws[int(0.95 * DRAWS) - 1]


def mean_difference(a: Sequence[float], b: Sequence[float]) -> float:
    return statistics.fmean(a) - statistics.fmean(b)


def load(specs: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for spec in specs:
        label, _, pattern = spec.rpartition("=") if "=" in spec else ("all", "", spec)
        paths = sorted(glob.glob(pattern))
        if not paths:
            print(f"{pattern}: no such file", file=sys.stderr)
        for p in paths:
            doc = json.loads(Path(p).read_text())
            if not doc.get("turn_ratios"):
                print(f"{p}: no turn_ratios (not a --parts turns run?)", file=sys.stderr)
                continue
            groups.setdefault(label, []).append({**doc, "_path": p})
    return groups


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="[label=]file or glob of turns JSON")
    ap.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    groups = load(args.files)
    if not groups:
        print("no runs with windows", file=sys.stderr)
        return 2
    pooled: dict[str, list[float]] = {}
    for label, docs in groups.items():
        print(f"{label}:")
        ratios: list[float] = []
        floors = []
        for d in docs:
            r = d["turn_ratios"]
            f = floor(d)
            floors += [f] if f is not None else []
            ratios += r
            print(
                f"  {d['_path']}: {len(r)} windows, median {statistics.median(r):.3f}, "
                f"mean {statistics.fmean(r):.3f}, floor {'-' if f is None else f'{f:.3f}'}"
            )
        pooled[label] = ratios
        sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
        lo, hi = interval(rng, statistics.fmean, ratios)
        mlo, mhi = interval(rng, statistics.median, ratios)
        fl = f"{min(floors):.3f}-{max(floors):.3f}" if floors else "-"
        med, mean = statistics.median(ratios), statistics.fmean(ratios)
        print(
            f"  pooled {len(ratios)} windows of {len(docs)} runs: median {med:.3f} (90% "
            f"{mlo:.3f}-{mhi:.3f}), mean {mean:.3f} (90% {lo:.3f}-{hi:.3f}), one window's "
            f"sd {sd:.3f}; floors {fl}"
        )
    labels = list(pooled)
    for a, b in itertools.pairwise(labels):
        xa, xb = pooled[a], pooled[b]
        lo, hi = interval(rng, mean_difference, xa, xb)
        d = mean_difference(xa, xb)
        print(f"{a} - {b}: mean {d:+.3f} (90% {lo:+.3f} to {hi:+.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
