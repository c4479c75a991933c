"""The decode thread's time by stage: each stage's own time, nested stages apart."""

from __future__ import annotations

import pytest

from mlxq.worker import stages as stages_module
from mlxq.worker.stages import Stages


class Clock:
    """A clock that moves only when told (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(stages_module.time, "perf_counter", c)
    return c


def test_a_nested_stage_counts_for_itself_not_for_the_outer_one(clock):
    s = Stages()
    with s.on("outer"):
        clock.now += 0.020
        with s.on("inner"):
            clock.now += 0.030
        with s.on("inner"):
            with s.on("deepest"):
                clock.now += 0.005
            clock.now += 0.010
        clock.now += 0.001
    ms = s.snapshot()
    assert ms == {"deepest": 5.0, "inner": 40.0, "outer": 21.0}
    assert sum(ms.values()) == pytest.approx(66.0)  # the wall time, counted once


def test_a_stage_that_raises_is_still_counted_and_the_stack_unwinds(clock):
    s = Stages()
    with pytest.raises(ValueError), s.on("outer"), s.on("inner"):
        clock.now += 0.002
        raise ValueError("x")
    with s.on("after"):
        clock.now += 0.001
    assert s.snapshot() == {"after": 1.0, "inner": 2.0, "outer": 0.0}


def test_the_trace_has_each_stage_as_it_ended_with_its_own_time_and_notes(
    clock, tmp_path, monkeypatch
):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
    from stage_trace import read, summary

    path = tmp_path / "t.jsonl"
    monkeypatch.setenv(stages_module.TRACE_ENV, str(path))
    s = Stages.from_env()
    with s.on("decode"):
        s.note(rows=64, new=False)
        clock.now += 0.015
        with s.on("prefill"):
            s.note(rows=1, width=64, keys=96, new=True)
            clock.now += 0.040
    s.note(rows=3)  # no stage open: nothing to note, no error
    s.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [
        {
            "t": 100.015,
            "stage": "prefill",
            "ms": 40.0,
            "rows": 1,
            "width": 64,
            "keys": 96,
            "new": True,
        },
        {"t": 100.0, "stage": "decode", "ms": 15.0, "rows": 64, "new": False},
    ]
    assert [x["stage"] for x in read(path, start=100.01)] == ["prefill"]
    table = summary(read(path), slowest=1)
    assert "prefill, new shape" in table and "1 x 64, 96, True, 40.0" in table


def test_without_the_variable_nothing_is_traced(clock, monkeypatch):
    monkeypatch.delenv(stages_module.TRACE_ENV, raising=False)
    s = Stages.from_env()
    with s.on("decode"):
        s.note(rows=1)
    assert s._trace is None and s.snapshot() == {"decode": 0.0}


def test_a_synced_trace_writes_each_stages_wait_for_the_device(clock, tmp_path):
    import json

    waits = []

    def sync() -> None:  # the device: busy 3 ms past each stage's host work
        waits.append(clock.now)
        clock.now += 0.003

    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        s = Stages(f, sync)
        with s.on("decode"):
            clock.now += 0.010
    (line,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert (line["ms"], line["wait_ms"], len(waits)) == (13.0, 3.0, 1)


def test_a_steps_parts_go_to_the_trace_inside_its_time_and_nowhere_untraced(clock, tmp_path):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
    from stage_trace import summary

    untraced = Stages()
    with untraced.on("decode"), untraced.part("graph"):
        clock.now += 0.004
    assert untraced.snapshot() == {"decode": 4.0}

    def sync() -> None:  # the device: busy 1 ms past each part's host work
        clock.now += 0.001

    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        s = Stages(f, sync)
        for sampled, graph_ms in ((0, 0.004), (1, 0.006)):
            with s.on("decode"):
                s.note(rows=64, new=False, sampled=sampled)
                with s.part("graph"):
                    clock.now += graph_ms
                with s.part("wait"):
                    clock.now += 0.002
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["stage"], x["ms"], x.get("part")) for x in lines[:3]] == [
        ("graph", 5.0, True),
        ("wait", 3.0, True),
        ("decode", 9.0, None),  # whole: its parts stay its own time (and its sync: 1 ms)
    ]
    assert s.snapshot() == {"decode": 20.0}
    table = {r[:28].strip(): r.split() for r in summary(lines).splitlines()}
    # the parts by whether their step sampled, with the device's share of each
    greedy_graph = table["all greedy: graph"]
    assert greedy_graph[-10:-3] == ["1", "5.0", "5.00", "5.00", "5.00", "5.0", "1.0"]
    assert greedy_graph[-3] == "off-CPU"  # then the thread's blocked ms: total (mean)
    assert table["some sampled: graph"][-9] == "7.0"
    assert "graph" not in table  # not a stage of its own beside decode


def test_the_summary_splits_decode_steps_by_whether_rows_sample():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
    from stage_trace import summary

    lines = [
        {"t": 1.0, "stage": "decode", "ms": 15.0, "rows": 64, "new": False, "sampled": 0},
        {"t": 2.0, "stage": "decode", "ms": 17.0, "rows": 64, "new": False, "sampled": 1},
        {"t": 3.0, "stage": "decode", "ms": 19.0, "rows": 64, "new": False, "sampled": 2},
        {"t": 4.0, "stage": "decode", "ms": 90.0, "rows": 63, "new": True, "sampled": 0},
    ]
    table = {r.split("  ")[0]: r.split() for r in summary(lines).splitlines()}
    greedy = table["decode, all greedy"]
    some = table["decode, some sampled"]
    # passes and their total ms; a step of a batch size new to the worker counts in neither
    assert greedy[-6:-4] == ["1", "15.0"] and some[-6:-4] == ["2", "36.0"]


def test_the_summary_splits_decode_steps_by_the_rows_that_joined_or_left_before_them():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
    from stage_trace import summary

    def step(ms: float) -> dict:
        return {"t": 0.0, "stage": "decode", "ms": ms, "rows": 64, "new": False, "sampled": 0}

    lines = [
        step(15.0),
        {"t": 0.0, "stage": "rows_leave", "ms": 1.0},
        step(21.0),
        step(14.0),
        {"t": 0.0, "stage": "rows_join", "ms": 0.5},
        step(20.0),
        {"t": 0.0, "stage": "rows_join", "ms": 0.5},
        {"t": 0.0, "stage": "rows_leave", "ms": 1.0},
        step(22.0),
    ]
    table = {r.split("  ")[0]: r.split() for r in summary(lines).splitlines()}
    assert table["decode, rows unchanged"][-6:-4] == ["2", "29.0"]
    assert table["decode, after a join"][-6:-4] == ["1", "20.0"]
    assert table["decode, after a leave"][-6:-4] == ["2", "43.0"]
    # no row changed: no split
    table = {r.split("  ")[0] for r in summary([step(15.0)]).splitlines()}
    assert "decode, rows unchanged" not in table


def test_a_worker_stopped_leaves_its_whole_trace(
    tmp_path, monkeypatch, start_worker, redis_server, queue_name
):
    """The trace is buffered (64 KiB); a worker's stop writes out what is left, so a
    short run (or a run's last passes) is not lost."""
    import json
    import signal

    from mlxq.producer import Client

    path = tmp_path / "stages.jsonl"
    monkeypatch.setenv(stages_module.TRACE_ENV, str(path))
    w = start_worker(no_warm_up=True)
    job = Client(redis_server.url, queue=queue_name).submit("a short job", max_tokens=4)
    assert job.result(timeout=60).token_ids
    w.signal(signal.SIGTERM)
    assert w.proc.wait(60) == 0
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert sum(x["stage"] == "decode" for x in lines) >= 3, lines
    # a decode step's parts: the host's work (graph, sample, launch) and the wait
    parts = {x["stage"] for x in lines if x.get("part")}
    assert {"graph", "sample", "launch", "wait"} <= parts, parts


def test_since_gives_each_stage_grown_the_longest_first(clock):
    s = Stages()
    with s.on("decode"):
        clock.now += 0.004
    before = dict(s.ms)
    with s.on("prefill"):
        clock.now += 0.030
    with s.on("decode"):
        clock.now += 0.005
    assert s.since(before) == pytest.approx({"prefill": 30.0, "decode": 5.0})
    assert list(s.since(before)) == ["prefill", "decode"]
    assert s.since(dict(s.ms)) == {}


def test_a_worker_logs_each_turn_over_its_slow_turn_bound_with_its_stages(
    start_worker, redis_server, queue_name
):
    """A bound under any turn's time (0.01 ms): every turn with work is logged, by its
    longest stages; the default (1 s) is far over this CPU's turns."""
    import re

    from mlxq.producer import Client

    w = start_worker(no_warm_up=True, slow_turn_ms=0.01)
    job = Client(redis_server.url, queue=queue_name).submit("a short job", max_tokens=4)
    assert job.result(timeout=60).token_ids
    said = r"WARNING mlxq.worker: a decode turn took \d+ ms \(step \d+, (\d+) rows\): (.*)"
    turns = re.findall(said, w.output())
    assert turns, w.output()
    assert any(int(rows) == 1 and "decode" in where for rows, where in turns), turns
    assert all(re.fullmatch(r"\w+ \d+ ms(, \w+ \d+ ms){0,3}", where) for _, where in turns), turns


def test_the_budget_says_which_stage_and_which_steps_a_window_with_chat_rows_went_over_by():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
    from stage_trace import budget

    def step(ms: float, sampled: int = 0) -> dict:
        return {"t": 0.0, "stage": "decode", "ms": ms, "rows": 64, "new": False, "sampled": sampled}

    off = [step(8.0), {"t": 0.0, "stage": "post", "ms": 1.0}, step(8.0)]
    on = [
        step(9.0, sampled=1),
        {"t": 0.0, "stage": "prefill", "ms": 6.0, "rows": 1, "width": 16, "keys": 16},
        {"t": 0.0, "stage": "rows_join", "ms": 0.5},
        step(14.0, sampled=1),
        {"t": 0.0, "stage": "post", "ms": 2.0},
        step(8.0),
    ]
    lines = budget(off, 0.02, on, 0.045).splitlines()
    table = {r[:34].strip(): r.split()[-3:] for r in lines}
    assert table["decode, sampled"] == ["0.00", "3.00", "+3.00"]  # 9 ms over 3 steps
    assert table["decode, after a row change"] == ["0.00", "4.67", "+4.67"]
    assert table["decode, greedy"] == ["8.00", "2.67", "-5.33"]
    assert table["prefill of one row"] == ["0.00", "2.00", "+2.00"]
    assert table["post"] == ["0.50", "0.67", "+0.17"]
    assert table["the wall clock"] == ["10.00", "15.00", "+5.00"]
    assert "steps a second: 100.0 off, 66.7 on (0.667)" in lines
    # each kind's steps over the off windows' greedy step, per step of the on windows
    assert "  on, sampled: 1 steps, mean 9.00 ms (+0.33 ms a step over the off" in lines[-1]
    assert "after a row change: 1 steps, mean 14.00 ms (+2.00 ms" in lines[-3]


def test_a_parts_cpu_time_says_how_long_its_thread_was_blocked(tmp_path):
    """A part's ``cpu_ms`` is its thread's CPU time: a part that sleeps (blocked, as on
    the interpreter's lock) has almost none, one that computes has all of its time."""
    import json
    import time

    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        s = Stages(f)
        with s.on("decode"):
            with s.part("launch"):
                time.sleep(0.05)
            with s.part("graph"):
                until = time.thread_time() + 0.02
                while time.thread_time() < until:
                    pass
    parts = {x["stage"]: x for x in map(json.loads, path.read_text().splitlines())}
    assert parts["launch"]["ms"] >= 50 and parts["launch"]["cpu_ms"] < 25
    assert parts["graph"]["cpu_ms"] >= 19.9
    assert parts["graph"]["ms"] >= parts["graph"]["cpu_ms"] - 1  # the clocks' grain apart


def test_the_lock_table_gives_each_threads_share_of_the_on_and_off_windows(tmp_path):
    """ops/gil_sample.py reads py-spy's raw files (``--gil --threads``, 100 samples a
    second): a thread's samples over its windows' seconds, in milliseconds a second."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
    import gil_sample

    boot = "Thread._bootstrap (/usr/lib/python3.12/threading.py:1032)"
    claim = "Bridge.claim (/site/mlxq/worker/bridge.py:88)"
    parse = "loads (/site/json/__init__.py:346)"
    (tmp_path / "gil-01-off-4s.txt").write_text(
        "thread (11): MainThread;<module> (/bin/mlxq:8) 200\n"
        f"thread (12): mlxq-prefetch-2;{boot};{claim};{parse} 20\n"
    )
    (tmp_path / "gil-02-on-2s.txt").write_text(
        f"thread (12): mlxq-prefetch-2;{boot};{claim};{parse} 30\n"
        f"thread (12): mlxq-prefetch-2;{boot};{claim} 10\n"
    )
    (tmp_path / "gil-03-on-2s.log").write_text("py-spy's own log: not a window")
    held = gil_sample.read(tmp_path)
    assert held[False].seconds == 4 and held[True].seconds == 2
    threads, frames = gil_sample.table(held).split("\n\n")
    rows = {
        r.split("|")[1].strip(): r.split("|")[2:-1]
        for r in threads.splitlines()
        if r.startswith("| ")
    }
    # 20 samples of 10 ms over 4 s: 50 ms a second off; 40 over 2 s: 200 on
    assert [c.strip() for c in rows["mlxq-prefetch-"]] == ["50.0", "200.0", "+150.0"]
    assert [c.strip() for c in rows["MainThread"]] == ["500.0", "0.0", "-500.0"]
    # the frame is mlxq's innermost, not the library's below it
    assert "Bridge.claim (bridge.py)" in frames and "loads" not in frames


def test_the_summary_gives_the_device_wait_by_rows_and_sampled_rows():
    """A step's ``wait`` part, grouped by the decode line after it: 65 rows with a sampled
    one apart from 64 greedy rows (on a GPU the 65th row's step outran the host's)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
    from stage_trace import summary

    def step(rows: int, sampled: int, wait: float) -> list[dict]:
        return [
            {"t": 0.0, "stage": "wait", "part": True, "ms": wait, "cpu_ms": wait},
            {
                "t": 0.0,
                "stage": "decode",
                "ms": 6.0,
                "rows": rows,
                "new": False,
                "sampled": sampled,
            },
        ]

    lines = [x for _ in range(20) for x in step(64, 0, 0.1)]
    lines += [x for i in range(20) for x in step(65, 1, 3.0 if i % 4 == 0 else 0.2)]
    lines += [x for x in step(66, 2, 9.0)]  # one step: under the 20 a line needs
    got = [r for r in summary(lines).splitlines() if r.startswith("decode, ") and " rows, " in r]
    assert got == [
        "decode, 64 rows, none sampled: 20 steps waited 0.10 ms for the device at the mean, "
        "over 1 ms in 0%",
        "decode, 65 rows, some sampled: 20 steps waited 0.90 ms for the device at the mean, "
        "over 1 ms in 25%",
    ]


def test_the_summary_gives_decode_steps_by_kind_against_the_most_common():
    """Steps by what changed the batch before them, rows, sampled rows and slots: each
    kind's p50 and its parts', and how far over the most common kind's p50 it is."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
    from stage_trace import summary

    def step(ms: float, rows: int, sampled: int, slots: int, launch: float) -> list[dict]:
        return [
            {"t": 0.0, "stage": "graph", "part": True, "ms": 2.0, "cpu_ms": 2.0},
            {"t": 0.0, "stage": "launch", "part": True, "ms": launch, "cpu_ms": launch},
            {"t": 0.0, "stage": "wait", "part": True, "ms": 0.1, "cpu_ms": 0.1},
            {"t": 0.0, "stage": "decode", "ms": ms, "rows": rows, "new": False,
             "sampled": sampled, "slots": slots},
        ]  # fmt: skip

    lines = [x for _ in range(30) for x in step(6.0, 62, 0, 64, 3.5)]
    for _ in range(20):
        lines += [{"t": 0.0, "stage": "rows_join", "ms": 1.0}, *step(9.0, 63, 1, 64, 6.5)]
        lines += [{"t": 0.0, "stage": "rows_leave", "ms": 0.2}, *step(8.0, 62, 0, 64, 5.5)]
    lines += [{"t": 0.0, "stage": "rows_leave", "ms": 0.2}, *step(30.0, 61, 0, 64, 9.0)]
    text = summary(lines).splitlines()
    at = next(i for i, r in enumerate(text) if r.startswith("decode steps by kind"))
    assert [r.split() for r in text[at + 1 :]] == [
        ["steady,", "62", "rows", "(64", "slots)", "30", "6.00", "+0.00", "2.00", "3.50", "0.10"],
        ["join,", "63", "rows", "(64", "slots),", "sampled", "20", "9.00", "+3.00", "2.00",
         "6.50", "0.10"],
        ["leave,", "62", "rows", "(64", "slots)", "20", "8.00", "+2.00", "2.00", "5.50", "0.10"],
    ]  # fmt: skip


def test_the_trace_says_why_joins_copied():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
    from stage_trace import summary

    lines = [
        {"stage": "rows_join", "ms": 2.0, "t": 1.0, "copy": "no dead slot", "rows": 1},
        {"stage": "rows_join", "ms": 4.0, "t": 2.0, "copy": "no dead slot", "rows": 3},
        {"stage": "rows_join", "ms": 0.5, "t": 3.0},  # in place: nothing noted
        {"stage": "rows_join", "ms": 6.0, "t": 4.0, "copy": "a row longer than the batch"},
    ]
    text = summary(lines)
    assert "joins by a copy, by why not in place" in text, text
    table = {r[:34].strip(): r.split()[-3:] for r in text.splitlines() if r.startswith("  ")}
    assert table["no dead slot"] == ["2", "4", "3.00"]
    assert table["a row longer than the batch"] == ["1", "0", "6.00"]


def test_the_trace_splits_mlx_lms_bookkeeping_by_what_its_step_did():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
    from stage_trace import summary

    def step(other: float, *inner: dict) -> list[dict]:
        return [*inner, {"stage": "step_other", "ms": other, "t": 0.0}]

    decode = {"stage": "decode", "ms": 7.0, "t": 0.0, "rows": 62, "sampled": 0}
    refill = {"stage": "prefill", "ms": 15.0, "t": 0.0, "rows": 62, "width": 32, "keys": 32}
    one = {"stage": "prefill", "ms": 12.0, "t": 0.0, "rows": 1, "width": 32, "keys": 32}
    join = {"stage": "rows_join", "ms": 0.1, "t": 0.0}
    graph = {"stage": "graph", "part": True, "ms": 2.0, "t": 0.0}  # a part: no kind of its own
    lines = [
        *step(0.2, graph, decode),
        *step(0.4, graph, decode),
        *step(30.0, refill, join),
        *step(26.0, refill, join),
        *step(1.0, one, {"stage": "first_token", "ms": 0.4, "t": 0.0}, join, graph, decode),
        {"stage": "detokenize", "ms": 0.3, "t": 0.0},  # after its step_other: the next one's
        *step(0.1),
    ]
    text = summary(lines)
    rows = text.splitlines()
    at = rows.index("step_other by what else its step did")
    table = {r[:30].strip(): r.split()[-6:] for r in rows[at + 1 : at + 5]}
    assert list(table) == ["join+refill", "decode+first+join+prefill 1", "decode", "nothing else"]
    assert table["join+refill"][:2] == ["2", "56.0"], text  # passes, ms
    assert table["decode"][:3] == ["2", "0.6", "0.30"], text  # passes, ms, mean
    assert table["nothing else"][:2] == ["1", "0.1"], text
