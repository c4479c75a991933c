"""A worker that cannot serve well refuses to start, with one line saying why: a Redis user
that lacks what the worker does, a model other than the one the queue's live workers
serve. Real redis-server ACL users, real worker processes, the tiny model."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from mlxq.producer import Client, keys
from mlxq.producer.codec import MsgpackSerializer
from mlxq.worker import scripts as lua
from mlxq.worker.access import lacking, probes
from mlxq.worker.identity import directory_digest
from mlxq.worker.tiny import build_tiny_model

pytestmark = pytest.mark.e2e

UserFactory = Callable[..., str]


@pytest.fixture
def acl_user(redis_server, r) -> Iterator[UserFactory]:
    """``acl_user("-publish")``: a Redis user with the worker's keys, channels and every
    command, less or more what the rules say; returns its URL. Removed after the test."""
    made: list[str] = []

    def make(*rules: str, base: tuple[str, ...] = ("~rq:*", "~mlxq:*", "&mlxq:*", "+@all")):
        name = f"u-{uuid.uuid4().hex[:8]}"
        r.execute_command("ACL", "SETUSER", name, "reset", "on", ">pw", *base, *rules)
        made.append(name)
        return redis_server.url.replace("redis://", f"redis://{name}:pw@")

    yield make
    for name in made:
        r.execute_command("ACL", "DELUSER", name)


def _refused(w) -> str:
    """The worker's exit (it must fail) and its last line, which must be the reason."""
    assert w.proc.wait(60) == 1, w.output()
    out = w.output()
    assert "Traceback" not in out, out
    return out.strip().splitlines()[-1]


def test_every_command_a_script_calls_is_checked():
    checked = {p.name for p in probes("w", ["q"])}
    called = {
        m.upper()
        for s in lua.SCRIPTS.values()
        for m in re.findall(r"redis\.p?call\(\s*'(\w+)'", s.source)
    }
    assert called and called <= checked, called - checked


def test_a_user_lacking_commands_keys_or_channels_is_refused_at_start(
    acl_user, start_worker, queue_name, r
):
    cases = [
        (("-publish", "-blmove"), "commands BLMOVE, PUBLISH"),
        (("-evalsha",), "commands EVALSHA"),
        (("-multi",), "commands MULTI"),
        (("resetchannels",), "channels mlxq:chan:"),
        (("resetkeys", "~rq:*"), "keys mlxq:"),
    ]
    for rules, named in cases:
        w = start_worker(redis_url=acl_user(*rules), ready=False)
        line = _refused(w)
        assert line.startswith("mlxq: Redis user 'u-") and named in line, (rules, line)
        assert "ACL SETUSER" in line
        # Refused before it registered: no record of it, nothing of its queue touched.
        assert not r.exists(keys.rq_worker_key(w.name), keys.alive_key(w.name))
        assert not r.sismember(keys.workers_key(queue_name), w.name)


def test_wait_is_needed_only_to_wait_for_replicas_and_info_only_to_see_failovers(
    acl_user, start_worker, queue_name, redis_server
):
    # Ends that wait for replicas need WAIT: refused at start, named.
    line = _refused(start_worker(redis_url=acl_user("-wait"), wait_replicas=1, ready=False))
    assert line.startswith("mlxq: Redis user 'u-") and "commands WAIT" in line, line
    # Without INFO (and without WAIT, which it does not use) it serves, and says what it lacks.
    w = start_worker(redis_url=acl_user("-info", "-wait"))
    assert "may not run INFO: it cannot tell when a failover" in w.output(), w.output()
    client = Client(redis_server.url, queue=queue_name)
    assert client.submit("Hello", max_tokens=4).result(timeout=60).finish_reason == "length"
    client.close()
    assert "Traceback" not in w.output()


def test_a_user_with_what_the_refusal_suggests_serves(acl_user, start_worker, queue_name, r):
    url = acl_user()  # ~rq:* ~mlxq:* &mlxq:* +@all, as the refusal's line suggests
    assert not lacking(redis.Redis.from_url(url), "w", [queue_name])
    start_worker(redis_url=url)
    client = Client(url, queue=queue_name)
    job = client.submit("Hello", max_tokens=4)
    chunks = list(job.stream(timeout=60))
    assert chunks and job.result(timeout=60).text == "".join(c.text for c in chunks)
    client.close()


def _published(r: redis.Redis, name: str) -> str:
    """The model digest worker ``name`` publishes with its stats ("" until it does)."""
    raw = r.hget(keys.worker_stats_key(name), "stats")
    return str(MsgpackSerializer.loads(raw).get("model_digest", "")) if raw else ""


def test_a_worker_with_another_model_refuses_the_queue_unless_told(
    tiny_model, tmp_path, start_worker, queue_name, r, monkeypatch, redis_server
):
    other = build_tiny_model(tmp_path / "other", seed=1)  # same shape, other weights
    copy = Path(shutil.copytree(tiny_model, tmp_path / "copy"))  # the same model elsewhere
    assert directory_digest(copy) == directory_digest(tiny_model) != directory_digest(other)
    first = start_worker()
    wait_until = time.monotonic() + 30
    while not _published(r, first.name):
        assert time.monotonic() < wait_until, first.output()
        time.sleep(0.05)
    digest = _published(r, first.name)
    assert digest == directory_digest(tiny_model)

    line = _refused(start_worker(model=other, ready=False))
    assert "is not the one live workers of its queues serve" in line, line
    assert f"worker {first.name} on queue {queue_name!r}" in line and digest in line
    assert "--allow-mixed-models" in line

    same = start_worker(model=copy)  # another path, the same model: welcome
    mixed = start_worker(model=other, allow_mixed_models=True)
    assert "serving anyway (--allow-mixed-models)" in mixed.output()
    monkeypatch.setenv("MLXQ_ALLOW_MIXED_MODELS", "1")
    start_worker(model=other)
    monkeypatch.setenv("MLXQ_ALLOW_MIXED_MODELS", "maybe")
    bad = start_worker(model=other, ready=False)
    assert bad.proc.wait(60) == 2 and "MLXQ_ALLOW_MIXED_MODELS='maybe'" in bad.output()

    info = subprocess.run(
        [sys.executable, "-m", "mlxq.producer.cli", "info", "--json"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MLXQ_REDIS_URL": redis_server.url},
    )
    workers = {w["name"]: w for w in json.loads(info.stdout)["workers"]}
    assert workers[same.name]["model_digest"] == digest
    assert workers[mixed.name]["model_digest"] == directory_digest(other)
