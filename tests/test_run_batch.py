"""``mlxq run-batch`` end to end: real worker processes on the tiny model, a real Redis,
the command run as a process; output checked against OpenAI's own types."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from opshelp import settled
from rq import Queue

from mlxq.producer import Client, keys
from mlxq.producer.batch import BatchConfig
from mlxq.producer.batch.files import Journal, LineFile
from mlxq.producer.batch.lines import LineChecker, LineError, LineReader, LongLine, Request
from mlxq.producer.batch.records import answered_id, failure, line_error, reported_line
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.openai_api import CHAT, COMPLETIONS, parse_request

# -- helpers -------------------------------------------------------------------------------


def chat(cid: str, text: str, model: str, **body: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], **body}
    return {"custom_id": cid, "method": "POST", "url": CHAT, "body": body}


def comp(cid: str, text: str, model: str, **body: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": text, **body}
    return {"custom_id": cid, "method": "POST", "url": COMPLETIONS, "body": body}


def write_batch(path: Path, lines: list[Any]) -> Path:
    with path.open("w") as f:
        for x in lines:
            f.write((x if isinstance(x, str) else json.dumps(x)) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def wait_until(what: str, cond: Callable[[], bool], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


#: ``python -c LAUNCH FSIZE REPORT ARGS...`` runs ``mlxq ARGS`` with, FSIZE > 0, its files
#: unable to grow past FSIZE bytes (a write past it fails, EFBIG, as on a full disk; Python
#: ignores the SIGXFSZ that comes with it) and, REPORT given, its peak memory written there
#: (VmHWM, KiB): the process's own, which wait4's ru_maxrss is not (that also counts the
#: pages of the test process it was forked from).
LAUNCH = """
import resource, sys
from mlxq.producer.cli import main
fsize, report, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
if fsize:
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
rc = main(argv)
if report:
    with open("/proc/self/status") as f:
        peak = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(report, "w") as f:
        f.write(peak)
sys.exit(rc)
"""


class RunBatch:
    """``mlxq run-batch`` as a process; its stderr kept in a file."""

    def __init__(
        self,
        tmp: Path,
        url: str,
        inp: Path,
        out: Path,
        *extra: str,
        max_file_bytes: int = 0,
        peak: Path | None = None,
    ) -> None:
        self.log = tmp / f"run-batch-{time.monotonic_ns()}.log"
        self.peak = peak
        cmd = [sys.executable, "-m", "mlxq.producer.cli"]
        if max_file_bytes or peak is not None:  # see LAUNCH
            cmd = [sys.executable, "-c", LAUNCH, str(max_file_bytes), str(peak or "")]
        cmd += ["run-batch", "--input", str(inp), "--output", str(out), "--redis-url", url]
        self.proc = subprocess.Popen(
            [*cmd, *extra], stdout=subprocess.DEVNULL, stderr=self.log.open("wb")
        )

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"run-batch did not end:\n{self.stderr()}") from None

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


def registry_counts(r: Any, queue: str) -> tuple[int, int]:
    q = Queue(queue, connection=r, serializer=MsgpackSerializer)
    return q.finished_job_registry.count, q.canceled_job_registry.count


def answers(out: Path) -> list[dict[str, Any]]:
    return [rec for rec in read_jsonl(out) if rec["response"] is not None]


def assert_once_each(out: Path, cids: set[str], failed: frozenset[str] = frozenset()) -> list:
    """Each id answered once, with 200 unless it is one of ``failed``; the 200s returned."""
    got = answers(out)
    counts = Counter(rec["custom_id"] for rec in got)
    assert set(counts) == cids | failed and set(counts.values()) == {1}, counts.most_common(3)
    ok = [rec for rec in got if rec["custom_id"] not in failed]
    assert all(rec["response"]["status_code"] == 200 for rec in ok), ok[:2]
    return ok


def check_answer(rec: dict[str, Any], url: str, model: str, max_tokens: int) -> None:
    """One output line, field by field against OpenAI's Batch output and completion types."""
    assert set(rec) == {"id", "custom_id", "response", "error"}
    assert rec["id"].startswith("batch_req_") and rec["error"] is None
    resp = rec["response"]
    assert set(resp) == {"status_code", "request_id", "body"}
    assert resp["status_code"] == 200 and isinstance(resp["request_id"], str)
    body = resp["body"]
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].endswith(resp["request_id"]) and body["model"] == model
    assert isinstance(body["created"], int) and len(body["choices"]) == 1
    parsed: ChatCompletion | Completion
    if url == CHAT:
        parsed = ChatCompletion.model_validate(body)
        assert parsed.object == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert set(body["choices"][0]) == {"index", "message", "logprobs", "finish_reason"}
        assert parsed.choices[0].message.role == "assistant"
        assert isinstance(parsed.choices[0].message.content, str)
    else:
        parsed = Completion.model_validate(body)
        assert parsed.object == "text_completion" and body["id"].startswith("cmpl-")
        assert set(body["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
        assert isinstance(parsed.choices[0].text, str)
    assert parsed.choices[0].index == 0
    assert parsed.choices[0].finish_reason in ("stop", "length")
    u = parsed.usage
    assert u is not None and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens > 0 and 0 <= u.completion_tokens <= max_tokens


# -- parts without Redis -------------------------------------------------------------------


def test_line_checker_names_what_is_wrong_and_skips_what_was_answered():
    c = LineChecker(queue=None, answered={"done"})
    good = comp("a", "hi", "m", max_tokens=3)
    assert c.check(1, b"  \n") is None
    req = c.check(2, json.dumps(good).encode())
    assert isinstance(req, Request) and req.queue == "m" and req.req.submit["max_tokens"] == 3
    assert c.check(3, json.dumps(comp("done", "hi", "m")).encode()) is None and c.skipped == 1
    cases = {
        b"{not json": ("invalid_json_line", None),
        b"[1, 2]": ("invalid_json_line", None),
        json.dumps({"url": COMPLETIONS, "body": {}}).encode(): ("missing_custom_id", "custom_id"),
        json.dumps({**good, "custom_id": 7}).encode(): ("missing_custom_id", "custom_id"),
        json.dumps(good).encode(): ("duplicate_custom_id", "custom_id"),
        json.dumps({**good, "custom_id": "g", "method": "GET"}).encode(): (
            "invalid_method",
            "method",
        ),
        json.dumps({**good, "custom_id": "e", "url": "/v1/embeddings"}).encode(): (
            "invalid_url",
            "url",
        ),
        json.dumps(comp("t", "hi", "m", temperature="hot")).encode(): (
            "invalid_request",
            "temperature",
        ),
        json.dumps(comp("s", "hi", "m", stream=True)).encode(): ("invalid_request", "stream"),
        json.dumps(chat("n", "hi", "m", messages=[])).encode(): ("invalid_request", "messages"),
        json.dumps({**good, "custom_id": "b", "body": "x"}).encode(): ("invalid_request", "body"),
    }
    for i, (raw, (code, param)) in enumerate(cases.items(), start=10):
        e = c.check(i, raw)
        assert isinstance(e, LineError) and (e.code, e.param, e.line) == (code, param, i), raw
    forced = LineChecker(queue="q").check(1, json.dumps(comp("x", "hi", "other")).encode())
    assert isinstance(forced, Request) and forced.queue == "q" and forced.req.model == "other"
    no_model = {"custom_id": "y", "url": COMPLETIONS, "body": {"prompt": "hi"}}
    filled = LineChecker(queue="q").check(1, json.dumps(no_model).encode())
    assert isinstance(filled, Request) and filled.req.model == "q"


def test_generation_fields_reach_submit():
    c = LineChecker()
    for i, (field, value) in enumerate(
        [("min_tokens", 2), ("stop_token_ids", [5, 7]), ("logprobs", 1), ("presence_penalty", 1)],
        start=1,
    ):
        got = c.check(i, json.dumps(comp(f"x{i}", "hi", "m", **{field: value})).encode())
        assert isinstance(got, Request) and field in got.req.submit, got
    bad = c.check(9, json.dumps(comp("y", "hi", "m", stop_token_ids=[1, -2])).encode())
    assert isinstance(bad, LineError) and bad.param == "stop_token_ids[1]"


def test_submit_many_takes_the_callers_job_ids(r, queue_name):
    client = Client(connection=r, queue=queue_name)
    jobs = client.submit_many([dict(prompt="a"), dict(prompt="b")], job_ids=["id-1", "id_2"])
    assert [j.id for j in jobs] == ["id-1", "id_2"] and jobs[0].status() == "queued"
    for ids, match in [
        (["x"], "one id per job"),
        (["a b", "c"], r"job_ids\[0\]"),
        (["d", "d"], "distinct"),
    ]:
        with pytest.raises(ValueError, match=match):
            client.submit_many([dict(prompt="a"), dict(prompt="b")], job_ids=ids)
    for j in jobs:
        j.cancel()


def test_records_read_back_as_what_they_are():
    ok = {"id": "batch_req_1", "custom_id": "a", "response": {"status_code": 200}, "error": None}
    assert answered_id(ok) == "a" and reported_line(ok) is None
    bad = failure("b", "j1", "timeout: ran 5.0 s")
    assert bad["response"]["status_code"] == 504 and bad["error"]["code"] == "timeout"
    too_long = failure("d", "j3", "invalid job: prompt: 9000 tokens + max_tokens=16 exceed x")
    assert too_long["error"]["code"] == "invalid_request_error"
    too_long = failure("d", "j3", "invalid job: prompt: 9 tokens exceed the model's context of 8")
    assert too_long["response"]["status_code"] == 400
    assert too_long["error"]["code"] == "context_length_exceeded"
    assert failure("e", "j4", "worker error: boom")["response"]["status_code"] == 500
    assert answered_id(bad) == "b"
    assert failure("c", "j2", "canceled")["error"]["code"] == "job_canceled"
    err = line_error(LineError(7, None, "invalid_json_line", "not JSON"))
    assert answered_id(err) is None and reported_line(err) == 7
    assert set(err["error"]) == {"code", "message", "param", "line"}


def test_a_partial_last_line_is_cut_and_the_journal_keeps_only_what_is_unanswered(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"custom_id": "a", "response": {}}\n{"custom_id": "b", "resp')
    f = LineFile(out)
    seen: list[Any] = []
    assert f.scan(seen.append) == len(b'{"custom_id": "b", "resp')
    f.write([{"custom_id": "c", "response": {}}])
    f.close()
    assert [answered_id(x) for x in read_jsonl(out)] == ["a", "c"]

    path = tmp_path / "out.jsonl.journal"
    j = Journal(path)
    assert j.load(answered=set()) == {}
    j.record([("a", "j1"), ("b", "j2")])
    j.record([("b", "j3")])  # submitted again: the last id wins
    j.close()
    with path.open("ab") as torn:
        torn.write(b'{"custom_id": "z", "job')
    assert Journal(path).load(answered={"a"}) == {"b": "j3"}
    assert read_jsonl(path) == [{"custom_id": "b", "job_id": "j3"}]


def test_config_names_the_bad_field(tmp_path):
    inp = write_batch(tmp_path / "in.jsonl", [])
    with pytest.raises(ValueError, match="max_in_flight=0"):
        BatchConfig(inp, tmp_path / "o.jsonl", max_in_flight=0)
    with pytest.raises(ValueError, match=r"output=.*input"):
        BatchConfig(inp, inp)
    with pytest.raises(ValueError, match=r"input=.*no such file"):
        BatchConfig(tmp_path / "nope.jsonl", tmp_path / "o.jsonl")
    with pytest.raises(ValueError, match="folder"):
        BatchConfig(inp, tmp_path / "no" / "o.jsonl")


def test_a_line_over_the_cap_is_read_past_and_reported(tmp_path):
    good = json.dumps(comp("a", "hi", "m")).encode()
    cap = len(good) + 10
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"\n".join([good, b"x" * (cap + 1), b"y" * cap, b"z" * (3 * cap)]))
    reader = LineReader(inp, max_line_bytes=cap)
    got = list(reader)
    assert [n for n, _ in got] == [1, 2, 3, 4]
    assert got[0][1] == good + b"\n" and got[2][1] == b"y" * cap + b"\n", "up to the cap: read"
    assert got[1][1] == LongLine(cap + 1) and got[3][1] == LongLine(3 * cap)
    assert reader.offset == inp.stat().st_size
    checker = LineChecker(max_line_bytes=cap)
    assert isinstance(checker.check(*got[0]), Request)
    e = checker.check(*got[1])
    assert isinstance(e, LineError) and (e.line, e.code, e.custom_id) == (2, "line_too_long", None)
    assert f"{cap + 1} bytes" in e.message and f"max_line_bytes={cap}" in e.message
    with pytest.raises(ValueError, match="max_line_bytes=0"):
        LineReader(inp, max_line_bytes=0)


def test_files_that_cannot_take_a_run_are_refused_with_one_line(tmp_path, redis_server):
    inp = write_batch(tmp_path / "in.jsonl", [comp("a", "hi", "m")])
    with pytest.raises(ValueError, match="max_line_bytes=0"):
        BatchConfig(inp, tmp_path / "o.jsonl", max_line_bytes=0)
    with pytest.raises(ValueError, match=r"input=.*is a folder"):
        BatchConfig(tmp_path, tmp_path / "o.jsonl")
    for extra, what in [
        (["-o", str(tmp_path)], "is a folder"),
        (["-o", "/dev/null"], "not a regular file"),
        (["-o", str(tmp_path / "o.jsonl"), "--errors", "/dev/null"], "not a regular file"),
    ]:
        cmd = [sys.executable, "-m", "mlxq.producer.cli", "run-batch", "-i", str(inp), *extra]
        cmd += ["--redis-url", redis_server.url]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
        assert what in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert not Path("/dev/null.journal").exists()
    assert not (tmp_path / "o.jsonl").exists()


def test_help_shows_the_real_defaults():
    out = subprocess.run(
        [sys.executable, "-m", "mlxq.producer.cli", "run-batch", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "(default: 256)" in out and "--detach" in out and "--errors" in out


# -- end to end ----------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_mixed_file(tmp_path, redis_server, queue_name, start_worker):
    start_worker()
    q = queue_name
    lines: list[Any] = [
        chat("chat-0", "Hello there", q, max_tokens=8, temperature=0),
        comp("comp-0", "Once upon a time", q, max_tokens=8, temperature=0),
        chat(
            "chat-1",
            "Tell me",
            q,
            max_tokens=6,
            temperature=0.7,
            top_p=0.9,
            seed=3,
            stop=["\n"],
            user="u1",
            metadata={"run": "eval"},
        ),
        comp("comp-1", "A list:", q, max_tokens=5, max_completion_tokens=4, some_field=1),
        comp("comp-2", "Another", q, max_tokens=5, top_k=-1, some_field=2),
        "this is not JSON",
        {"method": "POST", "url": COMPLETIONS, "body": {"model": q, "prompt": "x"}},
        chat("chat-0", "a duplicate", q),
        {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"model": q}},
        comp("bad-temp", "x", q, temperature="hot"),
        comp("bad-topp", "x", q, top_p=2),
        "",
        comp("wants-logprobs", "Hi", q, max_tokens=4, temperature=0, logprobs=2),
        # Valid as a request, but longer than the tiny model's context: it fails in the worker.
        comp("too-long", "x" * 70_000, q, max_tokens=4),
    ]
    inp = write_batch(tmp_path / "in.jsonl", lines)
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    run = RunBatch(tmp_path, redis_server.url, inp, out, "--errors", str(err))
    assert run.wait() == 0, run.stderr()
    stderr = run.stderr()
    assert stderr.count("'some_field'") == 1, "one warning per unknown field name"

    expected_errors = {
        6: ("invalid_json_line", None),
        7: ("missing_custom_id", "custom_id"),
        8: ("duplicate_custom_id", "custom_id"),
        9: ("invalid_url", "url"),
        10: ("invalid_request", "temperature"),
        11: ("invalid_request", "top_p"),
    }
    valid = {"chat-0", "comp-0", "chat-1", "comp-1", "comp-2"}
    valid.add("wants-logprobs")
    got = assert_once_each(out, valid, failed=frozenset({"too-long"}))
    (bad,) = [rec for rec in answers(out) if rec["custom_id"] == "too-long"]
    assert bad["response"]["status_code"] == 400, bad  # the line's fault, as the gateway says
    assert bad["error"]["code"] == "context_length_exceeded", bad["error"]
    assert "prompt" in bad["error"]["message"], bad["error"]
    assert bad["response"]["body"]["error"]["message"] == bad["error"]["message"]
    by_id = {rec["custom_id"]: rec for rec in got}
    for x in (lines[i] for i in (0, 1, 2, 3, 4, 12)):
        if x["custom_id"] in by_id:
            max_tokens = x["body"].get("max_completion_tokens", x["body"].get("max_tokens"))
            check_answer(by_id[x["custom_id"]], x["url"], q, max_tokens)
    assert by_id["comp-1"]["response"]["body"]["usage"]["completion_tokens"] <= 4
    assert by_id["wants-logprobs"]["response"]["body"]["choices"][0]["logprobs"] is not None

    errors = read_jsonl(err)
    assert {e["error"]["line"]: (e["error"]["code"], e["error"]["param"]) for e in errors} == (
        expected_errors
    )
    for e in errors:
        assert set(e) == {"id", "custom_id", "response", "error"} and e["response"] is None
        assert e["id"].startswith("batch_req_") and e["error"]["message"]
    assert [e["custom_id"] for e in errors if e["error"]["line"] == 8] == ["chat-0"]

    # The same mapping as the gateway's: the same job through the client gives the same text.
    client = Client(redis_server.url, queue=q)
    direct = client.submit(**parse_request(lines[0]["body"], CHAT).submit)
    text = by_id["chat-0"]["response"]["body"]["choices"][0]["message"]["content"]
    assert direct.result(timeout=60).text == text
    client.close()
    assert not (tmp_path / "out.jsonl.journal").exists(), "a complete sweep leaves no journal"

    again = RunBatch(tmp_path, redis_server.url, inp, out, "--errors", str(err))
    assert again.wait() == 0, again.stderr()
    assert len(read_jsonl(out)) == len(got) + 1 and len(read_jsonl(err)) == len(errors)


@pytest.mark.e2e
def test_queue_runs_every_line_there(tmp_path, redis_server, queue_name, start_worker, r):
    from mlxq.producer.listing import job_queue

    start_worker()
    elsewhere = f"{queue_name}-unserved"
    lines: list[Any] = [
        comp("a", "Hello", elsewhere, max_tokens=4),
        chat("b", "Hello", elsewhere, max_tokens=4, service_tier="priority"),  # no routing here
        {"custom_id": "c", "method": "POST", "url": COMPLETIONS, "body": {"prompt": "Hi"}},
        comp("d", "Hello", elsewhere, service_tier="turbo"),
    ]
    inp = write_batch(tmp_path / "in.jsonl", lines)
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    run = RunBatch(
        tmp_path, redis_server.url, inp, out, "--errors", str(err), "--queue", queue_name
    )
    assert run.wait() == 0, run.stderr()
    got = assert_once_each(out, {"a", "b", "c"})
    assert {job_queue(r, rec["response"]["request_id"]) for rec in got} == {queue_name}
    ((line, param),) = [(e["error"]["line"], e["error"]["param"]) for e in read_jsonl(err)]
    assert (line, param) == (4, "service_tier")


def _long_file(tmp: Path, q: str, n: int, tokens: int, bad: dict[int, Any] | None = None) -> Path:
    # Seeded: whether the random model stops early is the same on every run.
    lines: list[Any] = [
        comp(f"r{i}", f"A long tale, part {i}", q, max_tokens=tokens, temperature=1.0, seed=i)
        for i in range(n)
    ]
    for at, line in sorted((bad or {}).items()):
        lines.insert(at - 1, line)
    return write_batch(tmp / "in.jsonl", lines)


@pytest.mark.e2e
def test_resume_after_kill9_loses_nothing_and_duplicates_nothing(
    tmp_path, redis_server, queue_name, start_worker, r
):
    start_worker(max_batch=8)
    n = 240
    bad = {50: "{oops", 120: comp("bad", "x", queue_name, top_p=7)}
    inp = _long_file(tmp_path, queue_name, n, 48, bad)
    out = tmp_path / "out.jsonl"
    first = RunBatch(tmp_path, redis_server.url, inp, out, "--max-in-flight", "16")
    wait_until("40 output lines", lambda: lines_in(out) >= 40)
    first.proc.kill()
    assert first.wait() == -signal.SIGKILL
    assert lines_in(out) < n, "killed mid-file"
    assert (tmp_path / "out.jsonl.journal").exists()
    with out.open("ab") as f:  # as if killed in the middle of writing a line
        f.write(b'{"id":"batch_req_torn","custom_id":"r1')

    second = RunBatch(tmp_path, redis_server.url, inp, out, "--max-in-flight", "16")
    assert second.wait() == 0, second.stderr()
    assert "partial last line" in second.stderr()
    assert_once_each(out, {f"r{i}" for i in range(n)})
    reported = Counter(reported_line(rec) for rec in read_jsonl(out)) - Counter({None: 10**9})
    assert reported == Counter({50: 1, 120: 1}), "each bad line reported once"
    finished, canceled = registry_counts(r, queue_name)
    assert (finished, canceled) == (n, 0), "every line's job ran exactly once"
    assert not (tmp_path / "out.jsonl.journal").exists()


@pytest.mark.e2e
def test_a_worker_killed_mid_sweep(tmp_path, redis_server, queue_name, start_worker, r):
    a = start_worker(max_batch=8)
    n = 160
    inp = _long_file(tmp_path, queue_name, n, 64)
    out = tmp_path / "out.jsonl"
    run = RunBatch(
        tmp_path, redis_server.url, inp, out, "--max-in-flight", "32", "--progress-every", "0.2"
    )
    started = Queue(queue_name, connection=r, serializer=MsgpackSerializer).started_job_registry
    running: list[str] = []
    while not running:  # killed while it runs jobs, not between a batch's end and the next
        wait_until(
            "16 output lines and jobs running", lambda: lines_in(out) >= 16 and started.count
        )
        a.freeze()  # frozen: what it has started stays started (once its last ends land)
        running = settled(lambda: started.get_job_ids(cleanup=False))
        if not running:
            a.signal(signal.SIGCONT)
    a.signal(signal.SIGKILL)
    a.proc.wait(10)
    start_worker(max_batch=8)  # same host: it sees the dead pid and requeues its jobs
    assert run.wait() == 0, run.stderr()
    progress = re.findall(r"mlxq run-batch: (\d+)/160 done", run.stderr())
    assert progress and int(progress[-1]) <= n, "plain progress lines when not a terminal"
    assert re.search(r"160 requests answered \(160 ok, 0 failed\).*\n.* tok/s", run.stderr())
    got = assert_once_each(out, {f"r{i}" for i in range(n)})
    attempts = {
        x["response"]["request_id"]: int(
            r.hget(f"rq:job:{x['response']['request_id']}", "mlxq_attempt")
        )
        for x in got
    }
    assert {attempts[i] for i in running} == {2}, "the dead worker's running jobs ran again"
    assert max(attempts.values()) == 2
    assert registry_counts(r, queue_name) == (n, 0)


def _quiet(r: Any, queue: str) -> bool:
    q = Queue(queue, connection=r, serializer=MsgpackSerializer)
    return q.count == 0 and q.started_job_registry.count == 0


@pytest.mark.e2e
def test_ctrl_c_cancels_what_is_in_flight_and_a_rerun_finishes(
    tmp_path, redis_server, queue_name, start_worker, r
):
    start_worker(max_batch=4)
    n = 80
    inp = _long_file(tmp_path, queue_name, n, 96)
    out = tmp_path / "out.jsonl"
    first = RunBatch(tmp_path, redis_server.url, inp, out, "--max-in-flight", "12")
    wait_until("8 output lines", lambda: lines_in(out) >= 8)
    first.proc.send_signal(signal.SIGINT)
    assert first.wait() == 130
    stderr = first.stderr()
    assert "stopped by SIGINT" in stderr and "jobs in flight canceled" in stderr
    assert f"resume with: mlxq run-batch --input {inp} --output {out}" in stderr
    wait_until("the canceled jobs leave the worker", lambda: _quiet(r, queue_name))
    answered, canceled = len(answers(out)), registry_counts(r, queue_name)[1]
    assert answered < n and canceled > 0

    second = RunBatch(tmp_path, redis_server.url, inp, out, "--max-in-flight", "12")
    assert second.wait() == 0, second.stderr()
    assert_once_each(out, {f"r{i}" for i in range(n)})
    assert registry_counts(r, queue_name) == (n, canceled), "the canceled lines ran again"


@pytest.mark.e2e
def test_ctrl_c_with_detach_leaves_jobs_running_for_the_rerun(
    tmp_path, redis_server, queue_name, start_worker, r
):
    start_worker(max_batch=4)
    n = 60
    inp = _long_file(tmp_path, queue_name, n, 96)
    out = tmp_path / "out.jsonl"
    first = RunBatch(tmp_path, redis_server.url, inp, out, "--max-in-flight", "12", "--detach")
    wait_until("4 output lines", lambda: lines_in(out) >= 4)
    first.proc.send_signal(signal.SIGINT)
    assert first.wait() == 130
    assert "left running" in first.stderr() and "--detach" in first.stderr()
    second = RunBatch(tmp_path, redis_server.url, inp, out, "--max-in-flight", "12")
    assert second.wait() == 0, second.stderr()
    assert_once_each(out, {f"r{i}" for i in range(n)})
    assert registry_counts(r, queue_name) == (n, 0), "re-attached: nothing submitted twice"


def _peak_kib(tmp: Path, url: str, inp: Path, out: Path, *extra: str) -> int:
    """run-batch's own peak memory over a whole run, which must succeed."""
    peak = tmp / f"peak-{time.monotonic_ns()}"
    run = RunBatch(tmp, url, inp, out, "--progress", "off", *extra, peak=peak)
    assert run.wait() == 0, run.stderr()
    return int(peak.read_text())


@pytest.mark.e2e
def test_memory_stays_flat_on_a_100k_line_file(tmp_path, redis_server, queue_name, start_worker):
    """100,000 lines of ~1.6 KB (160 MB) cost run-batch little more memory than 1,000:
    it streams the input. All but the last 8 lines are answered by an "earlier run", so
    it reads (and keeps the custom_ids of) every line, but runs only a few."""
    start_worker()
    pad = "x" * 1600

    def peak_rss_kb(n: int) -> int:
        inp, out = tmp_path / f"in{n}.jsonl", tmp_path / f"out{n}.jsonl"
        with inp.open("w") as f:
            for i in range(n):
                f.write(json.dumps(comp(f"r{i}", f"{i}", queue_name, max_tokens=2, pad=pad)))
                f.write("\n")
        with out.open("w") as f:
            for i in range(n - 8):
                rec = {"id": "batch_req_x", "custom_id": f"r{i}", "error": None}
                f.write(json.dumps({**rec, "response": {"status_code": 200, "body": {}}}) + "\n")
        peak = _peak_kib(tmp_path, redis_server.url, inp, out)
        assert len(read_jsonl(out)) == n
        inp.unlink()
        return peak

    small, big = peak_rss_kb(1_000), peak_rss_kb(100_000)
    assert big - small < 48 * 1024, (small, big)


@pytest.mark.e2e
def test_a_line_far_over_the_cap_costs_no_memory(tmp_path, redis_server, queue_name, start_worker):
    """A 128 MiB line in a file, and a 256 MiB one from a stream (a pipe that sends no
    newline for that long): each is an error line, read past and never held, and the line
    after it runs; run-batch's peak memory stays near that of a one-line file."""
    start_worker()
    url, q = redis_server.url, queue_name
    after = json.dumps(comp("after", "Hello", q, max_tokens=2)).encode() + b"\n"
    chunk = b"x" * (1 << 20)

    def check(out: Path, size: int) -> None:
        errors = [rec for rec in read_jsonl(out) if rec["response"] is None]
        assert [(e["error"]["line"], e["error"]["code"]) for e in errors] == [(1, "line_too_long")]
        assert f"is {size} bytes" in errors[0]["error"]["message"]
        assert_once_each(out, {"after"})

    small = write_batch(tmp_path / "small.jsonl", [comp("s", "Hello", q, max_tokens=2)])
    base = _peak_kib(tmp_path, url, small, tmp_path / "small.out")

    big = tmp_path / "big.jsonl"
    with big.open("wb") as f:
        f.write(b'{"custom_id": "huge", "body": "')
        for _ in range(128):
            f.write(chunk)
        f.write(b'"}\n' + after)
    head = len(b'{"custom_id": "huge", "body": "') + 128 * len(chunk) + 2
    in_file = _peak_kib(tmp_path, url, big, tmp_path / "big.out")  # the cap: 16 MiB
    big.unlink()
    check(tmp_path / "big.out", head)

    fifo = tmp_path / "stream"
    os.mkfifo(fifo)

    def feed() -> None:
        with fifo.open("wb") as f:
            for _ in range(256):
                f.write(chunk)
            f.write(b"\n" + after)

    threading.Thread(target=feed, daemon=True).start()
    streamed = _peak_kib(
        tmp_path, url, fifo, tmp_path / "stream.out", "--max-line-bytes", "1048576"
    )
    check(tmp_path / "stream.out", 256 * len(chunk))
    assert in_file - base < 64 * 1024 and streamed - base < 32 * 1024, (base, in_file, streamed)


@pytest.mark.e2e
def test_a_full_disk_stops_with_one_line_and_a_rerun_finishes(
    tmp_path, redis_server, queue_name, start_worker, r
):
    start_worker()
    n = 60
    inp = _long_file(tmp_path, queue_name, n, 4)
    out, journal = tmp_path / "out.jsonl", tmp_path / "out.jsonl.journal"
    limit = 16 * 1024  # room for the journal (60 short lines), not for 60 answers
    first = RunBatch(tmp_path, redis_server.url, inp, out, max_file_bytes=limit)
    assert first.wait() == 1, first.stderr()
    stderr = first.stderr()
    assert f"stopped: {out}: File too large" in stderr and "Traceback" not in stderr, stderr
    assert f"resume with: mlxq run-batch --input {inp} --output {out}" in stderr
    assert journal.exists() and 0 < lines_in(out) < n  # and maybe a partial last line

    second = RunBatch(tmp_path, redis_server.url, inp, out)
    assert second.wait() == 0, second.stderr()
    assert_once_each(out, {f"r{i}" for i in range(n)})
    assert registry_counts(r, queue_name) == (n, 0), "the rerun collected, nothing ran twice"
    assert not journal.exists()


@pytest.mark.e2e
def test_an_input_cut_while_it_runs_is_not_complete(
    tmp_path, redis_server, queue_name, start_worker, r
):
    n, keep = 300, 200
    inp = _long_file(tmp_path, queue_name, n, 4)
    whole = inp.read_bytes()
    out, journal = tmp_path / "out.jsonl", tmp_path / "out.jsonl.journal"
    run = RunBatch(tmp_path, redis_server.url, inp, out, "--max-in-flight", "8")
    # No worker yet: the run fills its window, then waits, its reader near the start.
    wait_until("the window full", lambda: lines_in(journal) >= 8)
    os.truncate(inp, len(b"".join(whole.splitlines(keepends=True)[:keep])))
    start_worker()
    assert run.wait() == 1, run.stderr()
    stderr = run.stderr()
    assert "not complete: the input ended at byte" in stderr and "truncated" in stderr, stderr
    assert "Traceback" not in stderr
    assert_once_each(out, {f"r{i}" for i in range(keep)})
    assert journal.exists(), "kept for the rerun"

    inp.write_bytes(whole)
    again = RunBatch(tmp_path, redis_server.url, inp, out, "--max-in-flight", "8")
    assert again.wait() == 0, again.stderr()
    assert_once_each(out, {f"r{i}" for i in range(n)})
    assert registry_counts(r, queue_name) == (n, 0)


@pytest.mark.e2e
def test_a_rerun_with_another_input_cancels_the_jobs_it_does_not_name(
    tmp_path, redis_server, queue_name, start_worker, r
):
    q = queue_name
    out, journal = tmp_path / "out.jsonl", tmp_path / "out.jsonl.journal"
    first = RunBatch(
        tmp_path, redis_server.url, _long_file(tmp_path, q, 40, 4), out, "--max-in-flight", "16"
    )
    queued = Queue(q, connection=r, serializer=MsgpackSerializer)
    wait_until("16 jobs queued", lambda: queued.count >= 16)  # no worker: they wait
    first.proc.kill()
    first.wait()
    strays = [rec["job_id"] for rec in read_jsonl(journal)]
    other = tmp_path / "other.jsonl"
    write_batch(other, [comp(f"o{i}", "Hello", q, max_tokens=4) for i in range(5)])
    second = RunBatch(tmp_path, redis_server.url, other, out)
    wait_until("the strays settled", lambda: "had ended" in second.stderr())
    start_worker()
    assert second.wait() == 0, second.stderr()
    stderr = second.stderr()
    assert "names 16 job(s) an earlier run submitted" in stderr, stderr
    assert "16 still queued or running: canceled; 0 had ended" in stderr, stderr
    assert "0 never reached Redis" in stderr
    assert_once_each(out, {f"o{i}" for i in range(5)})
    assert {r.hget(keys.job_key(j), "status") for j in strays} == {b"canceled"}
    assert registry_counts(r, q) == (5, 16)


@pytest.mark.e2e
def test_a_roll_of_another_type_costs_only_the_advice(
    tmp_path, redis_server, queue_name, start_worker, r
):
    roll = keys.workers_key(queue_name)
    r.set(roll, "junk")
    inp = _long_file(tmp_path, queue_name, 6, 4)
    out = tmp_path / "out.jsonl"
    run = RunBatch(tmp_path, redis_server.url, inp, out)
    wait_until("the warning", lambda: "could not tell whether a live worker" in run.stderr())
    r.delete(roll)
    start_worker()
    assert run.wait() == 0, run.stderr()
    assert_once_each(out, {f"r{i}" for i in range(6)})
