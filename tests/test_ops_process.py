"""Operating mlxq, with workers of the tests' own: a restart seen through the CLI, stop
signals, a Redis outage in the log, the service units, one-line errors, help texts."""

from __future__ import annotations

import argparse
import os
import plistlib
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from conftest import RedisServer, _free_port
from opshelp import (
    MLXQ,
    Reader,
    Terminal,
    env_for,
    json_lines,
    mlxq,
    mlxq_all,
    rows_of,
    wait_for,
)
from rq import Worker

from mlxq.producer import Client
from mlxq.producer.terminal import RESTART_MARK, for_terminal

pytestmark = pytest.mark.e2e

OPS = Path(__file__).parents[1] / "ops"


def test_a_restart_mid_stream_leaves_only_the_result(redis_server, queue_name, start_worker, r):
    """A worker killed mid-job: ``submit --stream`` into a pipe marks the restart, and
    ``mlxq stream`` on a terminal erases the void text, so what stays is the result."""
    # Both listeners start before any worker does, so both show the first run's text.
    argv = [*MLXQ, "submit", "A long tale", "--stream", "--max-tokens", "1000"]
    argv += ["--temperature", "1", "--seed", "0", "--queue", queue_name]
    env = env_for(redis_server.url)
    piped = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert piped.stdout is not None and piped.stderr is not None
    job_id = piped.stderr.readline().decode().split()[2]
    piped_out = Reader(piped.stdout.fileno())
    term = Terminal([*MLXQ, "stream", job_id], env, cols=200, rows=100)
    first = start_worker()
    wait_for(lambda: piped_out.data and term.reader.data, "both to show text")
    first.signal(signal.SIGKILL)
    first.proc.wait(10)
    client = Client(redis_server.url, queue=queue_name)
    assert client.job(job_id).status() == "started", "killed mid-job"
    start_worker()  # same host: the dead worker's job is requeued at once
    assert piped.wait(120) == 0
    shown = term.finish(120)
    res = client.job(job_id).result(timeout=10)
    assert int(r.hget(f"rq:job:{job_id}", "mlxq_attempt")) == 2

    out = piped_out.join().decode()
    mark = RESTART_MARK.format(job_id=job_id, attempt=2)
    assert out.count(mark) == 1
    assert out.split(mark + "\n")[-1] == res.text + "\n"

    summary = [row for row in shown if row.startswith(f"[{job_id} finish_reason=")]
    assert len(summary) == 1
    # Started before any worker, it said so once, above the text (which the erase spares).
    assert shown[0].startswith(f"mlxq: warning: no live worker serves queue {queue_name!r}")
    text_rows = shown[1 : shown.index(summary[0])]
    assert text_rows == rows_of(for_terminal(res.text, 0), 200)
    assert b"\x1b[J" in term.reader.data, "the void text was erased, not scrolled away"
    client.close()


def test_a_second_stop_signal_requeues_at_once(redis_server, queue_name, start_worker):
    w = start_worker(grace_s=600, log_format="json", max_batch=4)
    client = Client(redis_server.url, queue=queue_name)
    jobs = client.submit_many(
        [dict(prompt="A long tale", max_tokens=2000, temperature=1.0, seed=s) for s in (0, 1)]
    )
    wait_for(lambda: all(j.status() == "started" for j in jobs), "both jobs to start")
    w.signal(signal.SIGTERM)
    wait_for(lambda: "within 600 s" in w.output(), "the first signal's log line")
    assert w.proc.poll() is None, "the first signal waits for the grace period"
    w.signal(signal.SIGINT)
    assert w.proc.wait(30) == 0
    assert [j.status() for j in jobs] == ["queued", "queued"]
    requeued = {d["job_id"]: d for d in json_lines(w.log) if d.get("event") == "requeued"}
    for j in jobs:
        assert requeued[j.id]["reason"] == "second stop signal"
        assert requeued[j.id]["queue"] == queue_name and "tokens" in requeued[j.id]
    for j in jobs:
        j.cancel()
    client.close()


def test_an_outage_is_logged_once_at_start_and_once_at_end(
    tmp_path, tiny_model, queue_name, start_worker
):
    own = RedisServer(tmp_path)
    try:
        w = start_worker(redis_url=own.url)
        own.stop()
        wait_for(lambda: "redis unavailable" in w.output(), "the outage warning")
        time.sleep(1.5)  # an outage of several retries (backoff 25 ms doubling to 0.5 s)
        own.start()
        client = Client(own.url, queue=queue_name)
        assert client.submit("after the outage", max_tokens=3).result(timeout=60).token_ids
        client.close()
        wait_for(lambda: "redis back" in w.output(), "the end of the outage")
        log = w.output()
        down = re.findall(r"WARNING \S+: (.+?): redis unavailable", log)
        back = re.findall(r"WARNING \S+: (.+?): redis back after", log)
        assert down and len(down) == len(set(down)), down  # once per component
        assert len(back) == len(set(back)) and set(back) <= set(down), back
        assert w.stop() == 0
    finally:
        own.stop()


# -- service units -----------------------------------------------------------------------


def _env_file(path: Path, tiny_model: Path, url: str, queue: str) -> dict[str, str]:
    values = {
        "MLXQ_MODEL": str(tiny_model),
        "MLXQ_REDIS_URL": url,
        "MLXQ_QUEUES": f"hi-{queue} {queue}",
        "MLXQ_MAX_BATCH": "4",
    }
    # Quoted as systemd's EnvironmentFile and a shell both read it (the queues' levels
    # are separated by spaces).
    path.write_text("".join(f'{k}="{v}"\n' for k, v in values.items()))
    return values


def _serves(url: str, queue: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    conn = redis.Redis.from_url(url)

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()
        return any(queue in w.queue_names() for w in Worker.all(connection=conn))

    wait_for(ready, "the unit's worker")
    with Client(url, queue=queue) as client:
        assert client.submit("from a unit", max_tokens=3).result(timeout=60).token_ids
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
    assert url not in cmdline and "--redis-url" not in cmdline, cmdline


def _stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


def _systemd(tmp_path: Path, values: dict[str, str]) -> list[str]:
    unit = (OPS / "mlxq-worker.service").read_text()
    (exec_start,) = re.findall(r"^ExecStart=(.+)$", unit, re.M)
    assert re.findall(r"^EnvironmentFile=(.+)$", unit, re.M) == ["/etc/mlxq/worker.env"]
    assert "REDIS_URL" not in exec_start
    # As systemd does: ${VAR} from the environment file, one word each.
    argv = [
        re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], a) for a in shlex.split(exec_start)
    ]
    assert argv[0] == "/opt/mlxq/venv/bin/mlxq"
    return [*MLXQ, *argv[1:]]


def _launchd(tmp_path: Path, env_file: Path) -> list[str]:
    with (OPS / "dev.mlxq.worker.plist").open("rb") as f:
        plist = plistlib.load(f)
    assert plist["KeepAlive"] is True and plist["RunAtLoad"] is True
    assert plist["ExitTimeOut"] > 30  # past the worker's --grace-s 30
    shell, flag, script = plist["ProgramArguments"]
    assert (shell, flag) == ("/bin/sh", "-c") and "REDIS_URL" not in script
    mlxq_bin = tmp_path / "mlxq"
    mlxq_bin.write_text(f'#!/bin/sh\nexec {sys.executable} -m mlxq.producer.cli "$@"\n')
    mlxq_bin.chmod(0o755)
    script = script.replace("/usr/local/etc/mlxq/worker.env", str(env_file))
    script = script.replace("/opt/mlxq/venv/bin/mlxq", str(mlxq_bin))
    return [shell, flag, script]


def test_service_units_keep_the_redis_url_off_the_command_line(redis_server, tiny_model, tmp_path):
    """The systemd unit (environment file + ExecStart, expanded as systemd does) and the
    launchd plist (a shell sources the file, then execs the worker) each run a worker that
    serves, with the Redis URL only in its environment."""
    procs = []
    try:
        for kind in ("systemd", "launchd"):
            queue = f"unit-{kind}-{uuid.uuid4().hex[:6]}"
            env_file = tmp_path / f"{kind}.env"
            values = _env_file(env_file, tiny_model, redis_server.url, queue)
            if kind == "systemd":
                argv, env = _systemd(tmp_path, values), dict(env_for(None), **values)
            else:
                argv, env = _launchd(tmp_path, env_file), env_for(None)
            log = tmp_path / f"{kind}.log"
            proc = subprocess.Popen(argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
            procs.append((proc, queue, log))
        for proc, queue, log in procs:
            _serves(redis_server.url, queue, proc, log)
    finally:
        for proc, _, log in procs:
            assert _stop(proc) == 0, log.read_text()


# -- errors and help ---------------------------------------------------------------------


def _one_line(out: subprocess.CompletedProcess[str], *words: str) -> None:
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxq: "), out.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_errors_are_one_line_with_what_to_do(redis_server, tiny_model, tmp_path):
    dead = f"redis://mlxq:s3cret@127.0.0.1:{_free_port()}/0"
    empty = tmp_path / "empty"
    empty.mkdir()
    unreachable = [
        ["submit", "hello"],
        ["info"],
        ["status", "some-id"],
        ["jobs"],
        ["worker", "--model", str(tiny_model)],
    ]
    models = [
        ("nope", ("'nope'", "Hugging Face")),
        (str(empty), (str(empty), "config.json")),
        ("/missing/path", ("/missing/path", "no model directory")),
    ]
    runs = [[*args, "--redis-url", dead] for args in unreachable]
    runs.append(["info", "--redis-url", dead, "--log-level", "DEBUG"])
    runs += [["worker", "--model", m, "--redis-url", redis_server.url] for m, _ in models]
    runs.append(["submit", "x", "--top-p", "3", "--redis-url", redis_server.url])
    runs.append(["worker", "--model", str(tiny_model), "--prompt-cache-bytes", "lots"])
    outs = mlxq_all(runs)
    cache = outs.pop()
    assert cache.returncode == 2 and "--prompt-cache-bytes: 'lots': give bytes" in cache.stderr
    for out in outs[: len(unreachable)]:
        _one_line(out, "cannot reach Redis", "redis://mlxq:***@127.0.0.1", "redis-server")
        assert "s3cret" not in out.stderr and out.returncode == 1
    debug = outs[len(unreachable)]
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    for out, (_, words) in zip(outs[len(unreachable) + 1 : -1], models, strict=True):
        _one_line(out, *words)
    assert outs[-1].returncode == 2 and "top_p=3.0" in outs[-1].stderr


def _options(parser: argparse.ArgumentParser, path: str = "mlxq"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif (
            action.option_strings and action.dest not in ("help", "version") and not action.required
        ):
            yield path, action


def test_help_version_and_defaults():
    from importlib import metadata

    from mlxq.producer.cli import _parser

    out = mlxq("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"mlxq {metadata.version('mlxq')}"
    seen = set()
    for path, action in _options(_parser()):
        seen.add(path)
        assert action.help and "default" in action.help, (path, action.option_strings)
    assert {"mlxq submit", "mlxq status", "mlxq result", "mlxq stream", "mlxq cancel"} <= seen
    assert {"mlxq jobs", "mlxq info", "mlxq worker"} <= seen
    secret = "redis://u:hush-hush@10.0.0.1:6379/0"
    for cmd in ("worker", "submit", "info"):
        out = subprocess.run(
            [*MLXQ, cmd, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(env_for(None), MLXQ_REDIS_URL=secret),
        )
        assert out.returncode == 0 and "hush-hush" not in out.stdout
        if cmd == "worker":
            assert "continuous" in out.stdout and "--metrics-port" in out.stdout


def test_demo_starts_its_own_redis_and_draws_one_row_a_job(tmp_path):
    """`make demo` writes into no Redis it was not given, and its live board keeps one row
    per job however the model's text (control characters, wide characters) comes out."""
    sys.path.insert(0, str(OPS))
    try:
        from demo import JOBS, last_cells, one_line
    finally:
        sys.path.remove(str(OPS))
    assert one_line("a\x0bb\x14c\nd\te") == "a\ufffdb\ufffdc d e"  # the tab to column 8
    assert last_cells("xx你好", 4) == "你好" and last_cells("xx你好", 5) == "x你好"

    env = env_for(None, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    env["COLUMNS"] = "80"  # the board is as wide as the terminal
    term = Terminal([sys.executable, str(OPS / "demo.py")], env, cols=80, rows=40)
    shown = term.finish(timeout=180)
    assert term.proc.returncode == 0, "\n".join(shown)
    assert any("started a private redis-server" in row for row in shown), shown
    board = [row for row in shown if " | " in row]
    for label, _ in JOBS:
        assert sum(row.startswith(f"{label:>20} | ") for row in board) == 1, shown
    assert len(board) == len(JOBS), shown

    given = subprocess.run(
        [sys.executable, str(OPS / "demo.py"), "--redis-url", "redis://127.0.0.1:1/0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert given.returncode != 0 and "no Redis answers at redis://127.0.0.1:1/0" in given.stderr
