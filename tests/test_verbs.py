"""rq's everyday verbs for mlxq jobs, through the real CLI and a real worker: ``mlxq retry``
(a new attempt of the same request, its stream replaced cleanly), ``mlxq purge`` (asks
first, refuses without --yes where nobody can answer), failure reasons in ``mlxq jobs``,
and what ``submit`` / ``result`` say about a queue no live worker serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from opshelp import MLXQ, Terminal, env_for, mlxq, wait_for

from mlxq.producer import Client, JobFailed, NoSuchJob
from mlxq.producer.job import read_log
from mlxq.producer.stream import Follow
from mlxq.producer.terminal import RESTART_MARK

pytestmark = pytest.mark.e2e


def _long(client: Client, **kw: Any):
    # Seed 0 runs to max_tokens on the tiny model: seconds, so it can be caught running.
    return client.submit("A long tale", max_tokens=2000, temperature=1.0, seed=0, **kw)


def _ended(job) -> str:
    return wait_for(
        lambda: (s := job.status()) in ("finished", "failed", "canceled") and s, f"{job.id}"
    )


def _listed(url: str, queue: str) -> dict[str, dict[str, Any]]:
    out = mlxq("jobs", "--queue", queue, "--json", url=url)
    assert out.returncode == 0, out.stderr
    return {j["id"]: j for j in json.loads(out.stdout)}


def _cancel_running(client: Client, url: str):
    """A job canceled while it streamed: the text a listener had shown, and the job."""
    job = _long(client)
    wait_for(lambda: job.status() == "started", "the long job to start")
    wait_for(lambda: read_log(client.redis, job.id, 1), "its first chunks")
    shown = read_log(client.redis, job.id, 1)
    out = mlxq("cancel", job.id, url=url)
    assert out.returncode == 0, out.stderr
    assert _ended(job) == "canceled"
    return job, shown


def test_retry_runs_failed_and_canceled_jobs_again(redis_server, queue_name, start_worker, r):
    url = redis_server.url
    start_worker(window_ms=0)
    client = Client(url, queue=queue_name)
    timed_out = _long(client, timeout=0.3)
    with pytest.raises(JobFailed, match="timeout"):
        timed_out.result(timeout=120)
    canceled, shown = _cancel_running(client, url)

    listed = _listed(url, queue_name)
    assert listed[timed_out.id]["failure_reason"].startswith("timeout: ran longer")
    assert listed[canceled.id]["failure_reason"] == "canceled"
    table = mlxq("jobs", "--queue", queue_name, url=url)
    assert "reason" in table.stdout.splitlines()[0]
    assert "timeout: ran longer than timeout=0.3 s" in table.stdout

    # A listener that showed the old run's text, then missed its end (a dropped channel).
    follow = Follow(canceled.id, 120)
    old = follow.on_log(shown)
    assert old and not any(c.final for c in old)

    out = mlxq("retry", canceled.id, timed_out.id, "no-such-id", url=url)
    assert out.returncode == 1
    assert out.stdout.splitlines() == [
        f"{canceled.id} requeued on {queue_name!r}",
        f"{timed_out.id} requeued on {queue_name!r}",
    ]
    assert "no-such-id: no such job" in out.stderr

    # A listener arriving now sees only the new run: exactly the result, no restart mark.
    stream = mlxq("stream", canceled.id, url=url, timeout=180)
    assert stream.returncode == 0, stream.stderr
    res = canceled.result(timeout=10)
    as_read = (res.text + "\n").replace("\r\n", "\n").replace("\r", "\n")  # text mode's newlines
    assert stream.stdout == as_read and res.finish_reason == "length"
    assert RESTART_MARK.split("{")[0] not in stream.stdout
    # The one that showed old text: a reset, then the new run's text, never a mix.
    new = follow.on_log(read_log(client.redis, canceled.id, follow.after))
    assert new[0].kind == "reset" and new[-1].final
    assert "".join(c.text for c in new[1:]) == res.text

    status = json.loads(mlxq("status", canceled.id, "--json", url=url).stdout)
    assert (status["status"], status["attempts"]) == ("finished", 2)
    again = mlxq("retry", canceled.id, url=url)
    assert again.returncode == 1 and "it is finished: only failed or canceled" in again.stderr

    # Retried runs are new attempts, each with the whole budget of failed runs again.
    for attempt in (2, 3, 4):
        assert _ended(timed_out) == "failed"
        d = json.loads(mlxq("status", timed_out.id, "--json", url=url).stdout)
        assert d["attempts"] == attempt and d["failure_reason"].startswith("timeout"), d
        if attempt < 4:  # (its status reads queued at once: _ended waits for the new end)
            out = mlxq("retry", "--failed", "--queue", queue_name, url=url)
            assert out.stdout.strip() == f"queue {queue_name!r}: 1 of 1 failed jobs requeued"
    none = mlxq("retry", "--canceled", "--queue", queue_name, url=url)
    assert none.returncode == 0 and "no canceled jobs in queue" in none.stderr
    bad = mlxq("retry", "--queue", queue_name, url=url)
    assert bad.returncode == 2 and "--failed / --canceled" in bad.stderr


def test_retry_of_a_job_that_never_started(redis_server, queue_name, start_worker):
    url = redis_server.url
    client = Client(url, queue=queue_name)
    job = client.submit("never runs", max_tokens=4)  # canceled while it waits
    assert job.cancel() is True
    start_worker()
    assert job.retry() is True and job.status() != "canceled"
    assert job.result(timeout=120).token_ids
    assert job.retry() is False  # finished: nothing to retry
    with pytest.raises(NoSuchJob):
        client.job("no-such-job")


def _queued(client: Client, n: int) -> list:
    return [client.submit(f"waits {i}", max_tokens=2) for i in range(n)]


def test_purge_asks_on_a_terminal_and_needs_yes_elsewhere(redis_server, queue_name, r):
    url = redis_server.url
    client = Client(url, queue=queue_name)  # no worker: the jobs wait
    jobs = _queued(client, 3)
    jobs[0].cancel()
    refused = subprocess.run(
        [*MLXQ, "purge", "--queue", queue_name],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        env=env_for(url),
    )
    assert refused.returncode == 2 and "add --yes" in refused.stderr
    assert "purge 3 jobs of queue" in refused.stderr and "2 queued" in refused.stderr
    assert all(j.status() for j in jobs)  # nothing went
    gone: list[BaseException] = []

    def listen() -> None:  # a listener waiting on a job that is purged
        try:
            list(jobs[1].stream(timeout=60))
        except NoSuchJob as e:
            gone.append(e)

    listener = threading.Thread(target=listen)
    listener.start()

    for answer, code in ((b"n\n", 1), (b"y\n", 0)):
        term = Terminal([*MLXQ, "purge", "--queue", queue_name, "--status", "queued"], env_for(url))
        wait_for(lambda t=term: b"[y/N]" in t.reader.data, "the question")
        os.write(term.master, answer)
        screen = "\n".join(term.finish(timeout=60))
        assert term.proc.returncode == code, screen
        assert f"purge 2 jobs of queue {queue_name!r} (2 queued)? [y/N]" in screen
    assert f"purged 2 jobs of queue {queue_name!r} (2 queued)" in screen
    for j in jobs[1:]:
        with pytest.raises(NoSuchJob):
            j.status()
    assert r.llen(f"rq:queue:{queue_name}") == 0
    listener.join(60)
    assert len(gone) == 1
    assert jobs[0].status() == "canceled"  # not asked for: stays
    out = mlxq("purge", "--queue", queue_name, "--status", "queued", "--yes", url=url)
    assert out.returncode == 0 and "holds no jobs to purge" in out.stderr


def test_purge_deletes_ended_jobs_and_their_streams_only(redis_server, queue_name, start_worker, r):
    url = redis_server.url
    start_worker()
    client = Client(url, queue=queue_name)
    done = client.submit("done", max_tokens=3)
    failed = _long(client, timeout=0.3)
    assert done.result(timeout=120).token_ids
    assert _ended(failed) == "failed"
    assert r.exists(f"mlxq:stream:{done.id}", f"mlxq:stream:{failed.id}") == 2
    out = mlxq("purge", "--queue", queue_name, "--status", "failed", "--yes", url=url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"purged 1 jobs of queue {queue_name!r} (1 failed)"
    with pytest.raises(NoSuchJob):
        failed.status()
    assert not r.exists(f"rq:results:{failed.id}", f"mlxq:stream:{failed.id}")
    assert not r.zcard(f"rq:failed:{queue_name}")
    with pytest.raises(NoSuchJob):  # a late listener: its job is gone, not failed
        list(failed.stream(timeout=30))
    assert done.status() == "finished"
    out = mlxq("purge", "--queue", queue_name, "--yes", url=url)
    assert "(0 queued, 0 failed, 1 finished, 0 canceled)" in out.stdout
    assert not r.exists(f"rq:job:{done.id}", f"mlxq:stream:{done.id}", f"rq:results:{done.id}")
    r.set(f"rq:failed:{queue_name}", "rogue")
    rogue = mlxq("purge", "--queue", queue_name, "--yes", url=url)
    assert rogue.returncode == 1 and "holds a string" in rogue.stderr
    r.delete(f"rq:failed:{queue_name}")


def test_a_queue_nobody_serves_is_said_once_and_waited_on(redis_server, queue_name, start_worker):
    url = redis_server.url
    idle = f"{queue_name}-idle"
    out = mlxq("submit", "hi", "--queue", idle, "--stream", "--wait", "1", url=url)
    assert out.returncode == 1
    assert out.stderr.count(f"no live worker serves queue {idle!r}") == 2  # warning + why
    warnings = [line for line in out.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "waits until one does" in warnings[0]
    assert "no end within --wait 1 s (it is still queued: no live worker" in out.stderr
    job_id = out.stderr.split("job ", 1)[1].split()[0]
    res = mlxq("result", job_id, "--wait", "0.5", url=url)
    assert res.returncode == 1 and f"no live worker serves queue {idle!r}" in res.stderr

    start_worker(window_ms=0)
    served = mlxq("submit", "hi", "--queue", queue_name, "--max-tokens", "3", "--stream", url=url)
    assert served.returncode == 0 and "warning" not in served.stderr, served.stderr
    long = mlxq("submit", "A long tale", "--queue", queue_name, "--max-tokens", "2000", url=url)
    job = Client(url).job(long.stdout.strip())
    wait_for(lambda: job.status() == "started", "the long job to start")
    waited = mlxq("result", job.id, "--wait", "0.2", url=url)
    assert waited.returncode == 1 and "it is running on worker" in waited.stderr
    job.cancel()
    Client(url).job(job_id).cancel()


def _rq(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    rq = os.path.join(os.path.dirname(sys.executable), "rq")
    return subprocess.run(
        [rq, *args, "-u", url], capture_output=True, text=True, timeout=60, env=env_for(url)
    )


def test_rq_requeue_and_rq_empty_do_what_the_readme_says(redis_server, queue_name, start_worker, r):
    """The README's words on rq's own verbs, held true: after ``rq requeue`` a failed job
    runs again as a new attempt, on the worker that ran it or on any other (rq leaves that
    worker's name on it: no one takes it for a duplicate of a job held elsewhere);
    ``rq empty`` deletes waiting jobs, and their listeners end."""
    url = redis_server.url
    first = start_worker(window_ms=0)
    client = Client(url, queue=queue_name)
    again, dropped = _long(client, timeout=0.3), _long(client, timeout=0.3)
    for job in (again, dropped):
        assert _ended(job) == "failed"
    r.zrem(f"rq:failed:{queue_name}", dropped.id)  # one at a time
    assert _rq("requeue", "--queue", queue_name, "--all", url=url).returncode == 0
    wait_for(
        lambda: json.loads(mlxq("status", again.id, "--json", url=url).stdout)["attempts"] == 2,
        "its second run",
    )
    assert first.stop() == 0
    second = start_worker(window_ms=0)
    r.zadd(f"rq:failed:{queue_name}", {dropped.id: time.time() + 3600})  # scored by expiry
    assert _rq("requeue", "--queue", queue_name, "--all", url=url).returncode == 0
    wait_for(
        lambda: json.loads(mlxq("status", dropped.id, "--json", url=url).stdout)["attempts"] == 2,
        "its second run, on another worker",
    )
    assert _ended(dropped) == "failed" and not r.llen(f"rq:queue:{queue_name}")
    assert "dropped a stale queue entry" not in second.output()

    assert second.stop() == 0  # nobody serves: jobs wait
    waiting = _queued(client, 2)
    gone: list[BaseException] = []

    def listen() -> None:
        try:
            list(waiting[0].stream(timeout=60))
        except NoSuchJob as e:
            gone.append(e)

    listener = threading.Thread(target=listen)
    listener.start()
    out = _rq("empty", queue_name, url=url)
    assert out.returncode == 0 and "2 jobs removed" in out.stdout
    listener.join(60)
    assert len(gone) == 1 and not r.exists(*(f"rq:job:{j.id}" for j in waiting))
