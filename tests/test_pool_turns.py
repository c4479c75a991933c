"""ops/pool_turns.py: the floor it reads off a turns run, and windows pooled by label."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
import pool_turns


def _run(path: Path, ratios: list[float], chat: int, sweep: int) -> str:
    turns = [
        {"on": False, "chat": 0, "sweep": 1000, "seconds": 4.0},
        {"on": True, "chat": chat, "sweep": sweep, "seconds": 4.0},
        {"on": False, "chat": 0, "sweep": 1000, "seconds": 4.0},
    ]
    path.write_text(json.dumps({"turns": turns, "turn_ratios": ratios}))
    return str(path)


def test_floor_is_the_chat_rows_share_off_095() -> None:
    on = {"on": True, "chat": 50, "sweep": 950, "seconds": 4.0}
    doc = {"turns": [on, {"on": False, "chat": 0, "sweep": 9, "seconds": 4.0}]}
    assert pool_turns.floor(doc) == pytest.approx(0.95 * 0.95)
    assert pool_turns.floor({"turns": []}) is None


def test_pools_runs_by_label_and_compares(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a1 = _run(tmp_path / "a1.json", [0.90, 0.92], 50, 950)
    a2 = _run(tmp_path / "a2.json", [0.94], 50, 950)
    b = _run(tmp_path / "b.json", [1.00, 1.02, 0.98], 0, 1000)
    assert pool_turns.main([f"a={tmp_path}/a*.json", f"b={b}"]) == 0
    out = capsys.readouterr().out
    assert f"{a1}: 2 windows, median 0.910" in out
    assert f"{a2}: 1 windows" in out
    assert "pooled 3 windows of 2 runs: median 0.920" in out
    assert "floors 0.902-0.902" in out
    assert "a - b: mean -0.080" in out


def test_no_runs_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.json").write_text(json.dumps({"turns": []}))
    assert pool_turns.main([str(tmp_path / "x.json"), str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    assert "no turn_ratios" in err and "none.json: no such file" in err
