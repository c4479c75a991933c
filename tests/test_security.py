"""Security: credentials and TLS in the Redis URL, unguessable job ids, key hygiene,
the queue cap, and a fixed corpus of rogue payloads that must be refused by name.

Real redis-server processes (some of this file's own: ACL, TLS, empty) and real
``mlxq worker`` processes; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgpack
import pytest
import redis
from conftest import WorkerProcess
from healthwatch import HealthWatch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rq import Queue
from rq.job import Job as RqJob
from rq.serializers import DefaultSerializer

from mlxq.producer import Client, JobFailed, MlxqError, PayloadError, QueueFull, keys
from mlxq.producer.codec import MsgpackSerializer, decode_chunk
from mlxq.producer.gateway.config import GatewayConfig
from mlxq.producer.gateway.metrics import METHODS
from mlxq.producer.openai_api.bounds import MAX_UNKNOWN_FIELDS, MAX_WARNED_NAMES
from mlxq.producer.params import GenerationRequest
from mlxq.worker.prefetch import decode_request

PASSWORD = "s3cret-Pw-7f3a"
WRONG_PASSWORD = "n0t-the-Pw-91c2"


# -- servers and workers of this file's own ----------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerDied(RuntimeError):
    """redis-server exited before it answered; the message is its log."""


@contextlib.contextmanager
def own_redis(workdir: Path, url: str, *args: str) -> Iterator[None]:
    """A redis-server with ``args`` (its port options among them), answering at ``url``."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server not found: install Redis (e.g. apt-get install redis-server)")
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "redis.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                exe,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        client = redis.Redis.from_url(url, socket_timeout=5)
        for _ in range(400):
            if proc.poll() is not None:
                raise ServerDied(log.read_text(errors="replace"))
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.025)
        else:
            raise RuntimeError(f"redis-server did not answer at {url}:\n{log.read_text()}")
        client.close()
        yield
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def fresh_redis(tmp_path: Path) -> Iterator[str]:
    """An empty redis-server of the test's own: every key in it was written by the test."""
    port = _free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with own_redis(tmp_path / "fresh", url, "--port", str(port)):
        yield url


Spawn = Callable[..., WorkerProcess]


@pytest.fixture
def spawn(start_worker: Callable[..., WorkerProcess]) -> Spawn:
    """``start_worker`` against any URL: ``spawn(url, queue, ready=True, **opts)``."""

    def start(url: str, queue: str, ready: bool = True, **opts: object) -> WorkerProcess:
        return start_worker(queue=queue, ready=ready, redis_url=url, **opts)

    return start


def run_one_job(url: str, queue: str) -> str:
    """Submit, stream and read one job through ``url``; returns its id."""
    client = Client(url, queue=queue)
    try:
        job = client.submit("Once upon a time", max_tokens=8, temperature=0.7, seed=1)
        text = "".join(c.text for c in job.stream(timeout=60))
        res = job.result(timeout=30)
        assert job.status() == "finished"
        assert res.token_ids and text == res.text
        return job.id
    finally:
        client.close()


# -- 1. credentials in the URL ------------------------------------------------------------


@pytest.mark.e2e
def test_acl_credentials_in_the_url(tmp_path, spawn, queue_name):
    port = _free_port()
    good = f"redis://alice:{PASSWORD}@127.0.0.1:{port}/0"
    acl = [
        "--port",
        str(port),
        "--user",
        "default",
        "off",
        "--user",
        "alice",
        "on",
        f">{PASSWORD}",
        "~*",
        "&*",
        "+@all",
    ]
    with own_redis(tmp_path / "acl", good, *acl):
        # The server really demands them: anonymous and wrong-password clients are refused.
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5).ping()

        # A worker with a wrong password, started beside a good one (both load the model).
        bad_worker = spawn(
            f"redis://alice:{WRONG_PASSWORD}@127.0.0.1:{port}/0", queue_name, ready=False
        )
        worker = spawn(good, queue_name)
        run_one_job(good, queue_name)

        for bad in (
            f"redis://alice:{WRONG_PASSWORD}@127.0.0.1:{port}/0",
            f"redis://127.0.0.1:{port}/0",
            f"redis://:{PASSWORD}@127.0.0.1:{port}/0",
        ):
            client = Client(bad, queue=queue_name)
            t0 = time.monotonic()
            with pytest.raises(redis.AuthenticationError):
                client.submit("never queued", max_tokens=2)
            assert time.monotonic() - t0 < 5, "a refused login must fail fast, not hang"
            client.close()

        # The bad worker exited non-zero on its own, and says why.
        assert bad_worker.proc.wait(60) != 0
        assert "AuthenticationError" in bad_worker.output()
        assert worker.stop() == 0
        for w in (worker, bad_worker):  # neither password ever reaches a log
            assert PASSWORD not in w.output() and WRONG_PASSWORD not in w.output()


# -- 2. TLS through rediss:// ---------------------------------------------------------------

OPENSSL_CNF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = mlxq throwaway test
[v3_ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[v3_srv]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for IP 127.0.0.1: (ca, cert, key)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl CLI to make a throwaway CA")
    d.mkdir()
    (d / "openssl.cnf").write_text(OPENSSL_CNF)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True, timeout=60)

    run(
        "req",
        "-x509",
        "-new",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-config",
        "openssl.cnf",
        "-extensions",
        "v3_ca",
        "-subj",
        "/CN=mlxq throwaway CA",
    )
    run(
        "req",
        "-new",
        *ec,
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-config",
        "openssl.cnf",
        "-subj",
        "/CN=127.0.0.1",
    )
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-set_serial",
        "1",
        "-days",
        "1",
        "-out",
        "server.pem",
        "-extfile",
        "openssl.cnf",
        "-extensions",
        "v3_srv",
    )
    return d / "ca.pem", d / "server.pem", d / "server.key"


@pytest.mark.e2e
def test_tls_end_to_end(tmp_path, spawn, queue_name):
    ca, cert, key = make_certs(tmp_path / "pki")
    port = _free_port()
    url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={quote(str(ca))}"
    tls = [
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(cert),
        "--tls-key-file",
        str(key),
        "--tls-ca-cert-file",
        str(ca),
        "--tls-auth-clients",
        "no",
    ]
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(own_redis(tmp_path / "tls", url, *tls))
        except ServerDied as e:
            if "tls" in str(e).lower():
                pytest.skip(f"this redis-server has no TLS: {str(e).strip()[-300:]}")
            raise
        # Only TLS is served, and the certificate is really checked.
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(f"redis://127.0.0.1:{port}/0?socket_timeout=5").ping()
        with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            redis.Redis.from_url(f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required").ping()

        worker = spawn(url, queue_name)
        run_one_job(url, queue_name)
        assert worker.stop() == 0


# -- 3. unguessable job ids ------------------------------------------------------------


def test_job_ids_are_random_uuid4(redis_server, queue_name):
    client = Client(redis_server.url, queue=queue_name)
    jobs = client.submit_many([dict(prompt=f"p{i}", max_tokens=1) for i in range(1000)])
    ids = [j.id for j in jobs]
    assert len(set(ids)) == 1000
    for i in ids:
        u = uuid.UUID(i)
        assert u.version == 4 and u.variant == uuid.RFC_4122 and str(u) == i
    Queue(queue_name, connection=client.redis, serializer=MsgpackSerializer).empty()
    client.close()


# -- 4. key hygiene ----------------------------------------------------------------------


@pytest.mark.e2e
def test_every_key_and_channel_is_prefixed(fresh_redis, spawn, queue_name):
    r = redis.Redis.from_url(fresh_redis)
    client = Client(fresh_redis, queue=queue_name)
    queued = client.submit("canceled before any worker", max_tokens=4)
    assert queued.cancel()
    rogue = Queue(queue_name, connection=r, serializer=MsgpackSerializer).enqueue(
        keys.JOB_FUNC, {"v": 1, "prompt": 42}
    )
    worker = spawn(fresh_redis, queue_name, window_ms=0)
    done = client.submit("finishes", max_tokens=6, temperature=0.5)
    assert done.result(timeout=60).token_ids
    with pytest.raises(JobFailed, match="prompt=42"):
        client.job(rogue.id).result(timeout=60)
    running = client.submit("canceled while running", max_tokens=2000, temperature=1.0)
    chunks = running.stream(timeout=60)
    next(chunks)
    channels = {c.decode() for c in r.pubsub_channels()}  # a listener and the worker's own
    assert running.cancel()
    assert [c.finish_reason for c in chunks][-1] == "canceled"
    seen = {k.decode() for k in r.scan_iter(count=1000)}
    assert worker.stop() == 0
    seen |= {k.decode() for k in r.scan_iter(count=1000)}

    stray = sorted(k for k in seen | channels if not k.startswith(("mlxq:", "rq:")))
    assert not stray, f"keys or channels outside mlxq: and rq: {stray}"
    # Not vacuous: mlxq's own keys and channels were there.
    assert keys.stream_key(done.id) in seen and keys.channel(running.id) in channels
    assert any(k.startswith("mlxq:worker:") for k in seen)
    assert any(c.startswith(keys.CANCEL_CHANNEL) for c in channels)
    client.close()


# -- 5. the queue cap ---------------------------------------------------------------------


def test_max_queued_refuses_and_enqueues_nothing(fresh_redis, queue_name):
    r = redis.Redis.from_url(fresh_redis)
    q = Queue(queue_name, connection=r, serializer=MsgpackSerializer)
    client = Client(fresh_redis, queue=queue_name, max_queued=3)
    client.submit_many([dict(prompt="a", max_tokens=1)] * 2)
    before = set(r.scan_iter(count=1000))
    with pytest.raises(QueueFull, match=r"max_queued=3"):  # all or nothing: 2 + 2 > 3
        client.submit_many([dict(prompt="b", max_tokens=1)] * 2)
    assert set(r.scan_iter(count=1000)) == before and q.count == 2
    client.submit("c", max_tokens=1)
    before = set(r.scan_iter(count=1000))
    with pytest.raises(QueueFull, match=r"max_queued=3") as e:
        client.submit("d", max_tokens=1)
    assert isinstance(e.value, MlxqError)
    assert set(r.scan_iter(count=1000)) == before and q.count == 3
    client.close()


def test_max_queued_caps_each_queue_a_submit_names(fresh_redis, queue_name):
    r = redis.Redis.from_url(fresh_redis)
    other = f"{queue_name}-other"
    client = Client(fresh_redis, queue=queue_name, max_queued=1)
    client.submit("a", max_tokens=1)
    assert Queue(other, connection=r).count == 0
    client.submit("b", max_tokens=1, queue=other)  # a cap of its own
    with pytest.raises(QueueFull, match=rf"queue '{other}' holds 1 jobs"):
        client.submit_many([dict(prompt="c", max_tokens=1)], queue=other)
    with pytest.raises(QueueFull, match=rf"queue '{queue_name}' holds 1 jobs"):
        client.submit("d", max_tokens=1)
    before = set(r.scan_iter(count=1000))
    for bad in ("", "q" * 129, 5):
        with pytest.raises(ValueError, match=r"^queue="):
            client.submit("e", max_tokens=1, queue=bad)  # type: ignore[arg-type]
    assert set(r.scan_iter(count=1000)) == before
    client.close()


# -- 6. the corpus of crashers ------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
P = {"v": 1, "prompt": "hi"}  # a good payload, to spoil one field at a time
M = {"v": 1}  # for chat payloads
HI = {"role": "user", "content": "hi"}
ALLOWED_CHAT = [{"role": "user", "content": "x" * 600_000}] * 2  # 1.2 M chars in all

#: (name, payload, the field its PayloadError must name), for GenerationRequest.from_payload.
PAYLOAD_CRASHERS: list[tuple[str, Any, str]] = [
    ("not a map: list", [1, "hi"], "payload"),
    ("not a map: None", None, "payload"),
    ("not a map: pickle bytes", b"\x80\x04K\x01.", "payload"),
    ("not a map: str", "hi", "payload"),
    ("not a map: int", 2**64, "payload"),
    ("version missing", {"prompt": "hi"}, "v"),
    ("version 2", {**P, "v": 2}, "v"),
    ("version 0", {**P, "v": 0}, "v"),
    ("version as str", {**P, "v": "1"}, "v"),
    ("version as bool", {**P, "v": True}, "v"),
    ("version as float", {**P, "v": 1.0}, "v"),
    ("unknown field", {**P, "__reduce__": "os.system"}, "payload"),
    ("unknown field smuggling the cap", {**P, "max_tokens_cap": 10**9}, "payload"),
    ("non-str key", {**P, 1: "x"}, "payload"),
    ("bytes key", {**P, b"prompt": "x"}, "payload"),
    ("None key", {**P, None: "x"}, "payload"),
    ("temperature NaN", {**P, "temperature": NAN}, "temperature"),
    ("temperature +inf", {**P, "temperature": INF}, "temperature"),
    ("temperature -inf", {**P, "temperature": -INF}, "temperature"),
    ("temperature negative", {**P, "temperature": -0.5}, "temperature"),
    ("temperature bool", {**P, "temperature": True}, "temperature"),
    ("temperature str", {**P, "temperature": "0.7"}, "temperature"),
    ("temperature None", {**P, "temperature": None}, "temperature"),
    ("temperature list", {**P, "temperature": [0.7]}, "temperature"),
    ("temperature int past float", {**P, "temperature": 2**1024}, "temperature"),
    ("top_p NaN", {**P, "top_p": NAN}, "top_p"),
    ("top_p 0", {**P, "top_p": 0}, "top_p"),
    ("top_p above 1", {**P, "top_p": 1.5}, "top_p"),
    ("top_p bool", {**P, "top_p": True}, "top_p"),
    ("top_p int past float", {**P, "top_p": 10**400}, "top_p"),
    ("min_p inf", {**P, "min_p": INF}, "min_p"),
    ("min_p NaN", {**P, "min_p": NAN}, "min_p"),
    ("min_p negative", {**P, "min_p": -0.1}, "min_p"),
    ("top_k bool", {**P, "top_k": True}, "top_k"),
    ("top_k float", {**P, "top_k": 40.0}, "top_k"),
    ("top_k negative", {**P, "top_k": -1}, "top_k"),
    ("top_k past int32", {**P, "top_k": 2**31}, "top_k"),
    ("top_k max uint64", {**P, "top_k": 2**64 - 1}, "top_k"),
    ("max_tokens 0", {**P, "max_tokens": 0}, "max_tokens"),
    ("max_tokens bool", {**P, "max_tokens": True}, "max_tokens"),
    ("max_tokens 2**64", {**P, "max_tokens": 2**64}, "max_tokens"),
    ("max_tokens float", {**P, "max_tokens": 8.0}, "max_tokens"),
    ("max_tokens NaN", {**P, "max_tokens": NAN}, "max_tokens"),
    ("max_tokens past the cap", {**P, "max_tokens": 32_769}, "max_tokens"),
    ("max_tokens str", {**P, "max_tokens": "8"}, "max_tokens"),
    ("seed negative", {**P, "seed": -1}, "seed"),
    ("seed 2**63", {**P, "seed": 2**63}, "seed"),
    ("seed 2**64", {**P, "seed": 2**64}, "seed"),
    ("seed bool", {**P, "seed": True}, "seed"),
    ("seed float", {**P, "seed": 1.0}, "seed"),
    ("seed str", {**P, "seed": "42"}, "seed"),
    ("prompt nested map", {**P, "prompt": {"role": "user", "content": "hi"}}, "prompt"),
    ("prompt list", {**P, "prompt": ["hi"]}, "prompt"),
    ("prompt bytes", {**P, "prompt": b"hi"}, "prompt"),
    ("prompt int", {**P, "prompt": 42}, "prompt"),
    ("prompt empty", {**P, "prompt": ""}, "prompt"),
    ("prompt too long", {**P, "prompt": "x" * 1_000_001}, "prompt"),
    ("neither prompt nor messages", {"v": 1}, "prompt"),
    ("both prompt and messages", {**P, "messages": [HI]}, "prompt"),
    ("messages: extra key", {**M, "messages": [{**HI, "name_x": "x"}]}, "messages[0]"),
    (
        "messages: calls on a user turn",
        {**M, "messages": [{**HI, "tool_calls": "x"}]},
        "messages[0].tool_calls",
    ),
    (
        "messages: extra key smuggled late",
        {**M, "messages": [HI, {**HI, "tool": 1}]},
        "messages[1]",
    ),
    ("messages: non-str key", {**M, "messages": [{**HI, 1: 2}]}, "messages[0]"),
    ("messages: content missing", {**M, "messages": [{"role": "user"}]}, "messages[0]"),
    (
        "messages: unknown role",
        {**M, "messages": [{"role": "root", "content": "hi"}]},
        "messages[0].role",
    ),
    (
        "messages: role a list",
        {**M, "messages": [{"role": ["user"], "content": "hi"}]},
        "messages[0].role",
    ),
    (
        "messages: content a map",
        {**M, "messages": [{"role": "user", "content": {"t": "hi"}}]},
        "messages[0].content",
    ),
    (
        "messages: content None",
        {**M, "messages": [{"role": "user", "content": None}]},
        "messages[0].content",
    ),
    (
        "messages: content bytes",
        {**M, "messages": [{"role": "user", "content": b"hi"}]},
        "messages[0].content",
    ),
    ("messages: empty", {**M, "messages": []}, "messages"),
    ("messages: a map", {**M, "messages": HI}, "messages"),
    ("messages: a string", {**M, "messages": "hi"}, "messages"),
    ("messages: not maps", {**M, "messages": ["hi"]}, "messages[0]"),
    ("messages: too many", {**M, "messages": [HI] * 1025}, "messages"),
    ("messages: too long in all", {**M, "messages": ALLOWED_CHAT}, "prompt"),
    ("stop: too many", {**P, "stop": ["a"] * 17}, "stop"),
    ("stop: empty string", {**P, "stop": [""]}, "stop"),
    ("stop: int inside", {**P, "stop": [1]}, "stop"),
    ("stop: bytes", {**P, "stop": b"\n"}, "stop"),
    ("stop: a map", {**P, "stop": {"a": 1}}, "stop"),
    ("stop: too long", {**P, "stop": ["x" * 257]}, "stop"),
    ("stop: an int", {**P, "stop": 5}, "stop"),
    ("stop: false", {**P, "stop": False}, "stop"),
    ("stop: zero", {**P, "stop": 0}, "stop"),
    ("metadata: a list", {**P, "metadata": [1]}, "metadata"),
    ("metadata: a str", {**P, "metadata": "x"}, "metadata"),
    ("metadata: non-str key", {**P, "metadata": {1: "x"}}, "metadata"),
    ("timeout 0", {**P, "timeout": 0}, "timeout"),
    ("timeout negative", {**P, "timeout": -1}, "timeout"),
    ("timeout NaN", {**P, "timeout": NAN}, "timeout"),
    ("timeout inf", {**P, "timeout": INF}, "timeout"),
    ("timeout bool", {**P, "timeout": True}, "timeout"),
    ("timeout str", {**P, "timeout": "10"}, "timeout"),
    ("timeout past a week", {**P, "timeout": 7 * 24 * 3600 + 1}, "timeout"),
    ("timeout int past float", {**P, "timeout": 10**400}, "timeout"),
    ("ttl 0", {**P, "ttl": 0}, "ttl"),
    ("ttl negative", {**P, "ttl": -0.001}, "ttl"),
    ("ttl NaN", {**P, "ttl": NAN}, "ttl"),
    ("ttl -inf", {**P, "ttl": -INF}, "ttl"),
    ("ttl bool", {**P, "ttl": False}, "ttl"),
    ("ttl int past float", {**P, "ttl": -(10**400)}, "ttl"),
]


def _chunk(**m: Any) -> bytes:
    return msgpack.packb(m, use_bin_type=True)  # type: ignore[no-any-return]


OK_CHUNK = {"s": 1, "k": "tokens"}

#: (name, bytes read from a stream or channel, the field its PayloadError must name).
CHUNK_CRASHERS: list[tuple[str, bytes, str]] = [
    ("empty", b"", "chunk"),
    ("never-used byte", b"\xc1", "chunk"),
    ("truncated map", b"\x82\xa1s\x01", "chunk"),
    ("pickle that would call print", b"cbuiltins\nprint\n(S'unpickled!'\ntR.", "chunk"),
    ("pickle protocol 4", b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00K\x01.", "chunk"),
    ("nested 100k deep", b"\x91" * 100_000 + b"\xc0", "chunk"),
    ("array32 claiming 4G items", b"\xdd\xff\xff\xff\xff", "chunk"),
    ("map32 claiming 4G pairs", b"\xdf\xff\xff\xff\xff", "chunk"),
    ("str32 claiming 4 GB", b"\xdb\xff\xff\xff\xff", "chunk"),
    ("invalid utf-8", b"\xa2\xff\xfe", "chunk"),
    ("ext type", b"\xd4\x01\x00", "chunk"),
    ("timestamp", b"\xd6\xff\x00\x00\x00\x00", "chunk"),
    ("bad timestamp", b"\xd7\xff" + b"\xff" * 8, "chunk"),
    ("a list", msgpack.packb([1, "tokens"]), "chunk"),
    ("a str", msgpack.packb("tokens"), "chunk"),
    ("int map keys", msgpack.packb({1: 2}), "chunk"),
    ("list map key", b"\x81\x91\x01\x01", "chunk"),
    ("trailing garbage", _chunk(**OK_CHUNK) + b"\x00", "chunk"),
    ("bytes keys", msgpack.packb({b"s": 1, b"k": "tokens"}, use_bin_type=True), "chunk.seq"),
    ("seq missing", _chunk(k="tokens"), "chunk.seq"),
    ("seq 0", _chunk(s=0, k="tokens"), "chunk.seq"),
    ("seq negative", _chunk(s=-(2**63), k="tokens"), "chunk.seq"),
    ("seq bool", _chunk(s=True, k="tokens"), "chunk.seq"),
    ("seq float", _chunk(s=1.0, k="tokens"), "chunk.seq"),
    ("seq str", _chunk(s="1", k="tokens"), "chunk.seq"),
    ("kind unknown", _chunk(s=1, k="evil"), "chunk.kind"),
    ("kind missing", _chunk(s=1), "chunk.kind"),
    ("kind a list", _chunk(s=1, k=["tokens"]), "chunk.kind"),
    ("attempt 0", _chunk(**OK_CHUNK, a=0), "chunk.attempt"),
    ("attempt bool", _chunk(**OK_CHUNK, a=True), "chunk.attempt"),
    ("attempt float", _chunk(**OK_CHUNK, a=1.5), "chunk.attempt"),
    ("text bytes", _chunk(**OK_CHUNK, t=b"hi"), "chunk.text"),
    ("text None", _chunk(**OK_CHUNK, t=None), "chunk.text"),
    ("text a map", _chunk(**OK_CHUNK, t={"x": "y"}), "chunk.text"),
    ("token_ids a str", _chunk(**OK_CHUNK, i="123"), "chunk.token_ids"),
    ("token_ids None", _chunk(**OK_CHUNK, i=None), "chunk.token_ids"),
    ("token_ids with a str", _chunk(**OK_CHUNK, i=[1, "2"]), "chunk.token_ids"),
    ("token_ids with a float", _chunk(**OK_CHUNK, i=[1.5]), "chunk.token_ids"),
    ("token_ids a map", _chunk(**OK_CHUNK, i={"0": 1}), "chunk.token_ids"),
    ("token_ids with a bool", _chunk(**OK_CHUNK, i=[True, False]), "chunk.token_ids"),
    ("finish_reason unknown", _chunk(**OK_CHUNK, f="evil"), "chunk.finish_reason"),
    ("finish_reason an int", _chunk(**OK_CHUNK, f=1), "chunk.finish_reason"),
    ("usage a list", _chunk(**OK_CHUNK, u=[1]), "chunk.usage"),
    ("usage a str", _chunk(**OK_CHUNK, u="x"), "chunk.usage"),
    ("usage with a str count", _chunk(**OK_CHUNK, u={"prompt_tokens": "many"}), "chunk.usage"),
    ("error an int", _chunk(s=1, k="error", e=5), "chunk.error"),
    ("error bytes", _chunk(s=1, k="error", e=b"x"), "chunk.error"),
]


def _cases(corpus: list[tuple[str, Any, str]]) -> list[Any]:
    return [pytest.param(data, field, id=name) for name, data, field in corpus]


def _names_field(err: Exception, field: str) -> bool:
    return re.match(re.escape(field) + r"[=:]", str(err)) is not None


@pytest.mark.parametrize(("payload", "field"), _cases(PAYLOAD_CRASHERS))
def test_rogue_payload_is_refused_by_name(payload, field):
    with pytest.raises(PayloadError) as e:
        GenerationRequest.from_payload(payload)
    assert _names_field(e.value, field), str(e.value)[:300]


@pytest.mark.parametrize(("data", "field"), _cases(CHUNK_CRASHERS))
def test_rogue_chunk_is_refused_by_name(data, field):
    with pytest.raises(PayloadError) as e:
        decode_chunk(data)
    assert _names_field(e.value, field), str(e.value)[:300]


#: (name, submit kwargs, the field the ValueError must name) that pass the schema but
#: cannot be sent as they are, or that the worker would refuse.
SUBMIT_CRASHERS: list[tuple[str, dict[str, Any], str]] = [
    ("metadata value msgpack cannot carry", dict(metadata={"x": object()}), "metadata"),
    ("metadata int past 64 bits", dict(metadata={"x": 2**64}), "metadata"),
    ("metadata with nested int keys", dict(metadata={"x": {1: 2}}), "metadata"),
    ("lone surrogate in the prompt", dict(prompt="a\ud800"), "prompt"),
    ("temperature int past float", dict(temperature=10**400), "temperature"),
]


@pytest.mark.parametrize(
    ("kwargs", "field"), [pytest.param(kw, field, id=name) for name, kw, field in SUBMIT_CRASHERS]
)
def test_submit_refuses_unsendable_values_by_name(fresh_redis, queue_name, kwargs, field):
    client = Client(fresh_redis, queue=queue_name)
    kwargs = {"prompt": "hi", "max_tokens": 2, **kwargs}
    try:
        with pytest.raises(PayloadError) as e:
            client.submit(**kwargs)
        assert _names_field(e.value, field), str(e.value)
    finally:
        assert client.redis.dbsize() == 0, "a refused submit must leave Redis untouched"
        client.close()


@pytest.mark.e2e
def test_huge_top_k_never_takes_down_its_neighbours(fresh_redis, spawn, queue_name):
    """A rogue producer writes top_k=2**31 straight into Redis; the job batched with it
    must still finish, and the rogue one must finish or fail naming top_k."""
    client = Client(fresh_redis, queue=queue_name)
    neighbour = client.submit("an innocent neighbour", max_tokens=8, temperature=1.0)
    rogue = Queue(queue_name, connection=client.redis, serializer=MsgpackSerializer).enqueue(
        keys.JOB_FUNC, {"v": 1, "prompt": "hi", "max_tokens": 4, "temperature": 1.0, "top_k": 2**31}
    )
    spawn(fresh_redis, queue_name, window_ms=200)  # both are queued: one batch
    assert neighbour.result(timeout=60).token_ids
    try:
        client.job(rogue.id).result(timeout=60)
    except JobFailed as e:
        assert "top_k" in e.reason
    client.close()


# -- the gateway under attack: labels, field names, bodies, keys ---------------------------
# Each attack runs while /health is polled (healthwatch.py): every poll must be answered
# ok; how long they took is printed (-s), never asserted.


def _send(port: int, request: bytes) -> int:
    """One raw HTTP request on a connection of its own; the status it was answered with."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(request)
        head = b""
        while b"\r\n" not in head and (chunk := s.recv(4096)):
            head += chunk
    return int(head.split(b" ", 2)[1])


def _text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as res:
        return str(res.read().decode())


def _post(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as res:
            return res.status, json.loads(res.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


def _longest_line(text: str) -> int:
    return max(map(len, text.splitlines()), default=0)


@pytest.mark.e2e
def test_made_up_http_methods_never_grow_the_metrics(start_gateway):
    g = start_gateway()
    before = _text(f"{g.url}/metrics")

    def made_up(i: int) -> int:
        method = f"M{i:05d}".ljust(15_000, "X")
        return _send(g.port, f"{method} /health HTTP/1.1\r\nHost: x\r\n\r\n".encode())

    # Methods HTTP knows but the gateway routes none of: each answered 405 and counted
    # under "other".
    odd = ["PROPFIND", "MKCOL", "COPY", "MOVE", "LOCK", "SEARCH", "PURGE", "LINK"]

    def known(i: int) -> int:
        return _send(g.port, f"{odd[i % len(odd)]} /health HTTP/1.1\r\nHost: x\r\n\r\n".encode())

    watch = HealthWatch(g.url, "5,000 requests with 15 KB made-up methods")
    with watch as hw, ThreadPoolExecutor(8) as pool:
        codes = set(pool.map(made_up, range(5000)))
        known_codes = set(pool.map(known, range(400)))
    hw.check()
    assert codes == {400}  # refused by the HTTP parser (httptools): the app never sees them
    assert known_codes == {405}
    after = _text(f"{g.url}/metrics")
    assert set(re.findall(r'method="([^"]*)"', after)) <= {*METHODS, "other"}
    assert 'method="other",route="/health",status="405"} 400.0' in after
    assert len(after) - len(before) < 5_000  # a series or two more, not one per request
    assert _longest_line(g.output()) < 1_000  # uvicorn's lines quote a method cut short


@pytest.mark.e2e
def test_unknown_fields_are_bounded_and_floods_of_them_get_400(start_gateway):
    g = start_gateway()
    url = f"{g.url}/v1/chat/completions"
    base = {
        "model": f"nobody-{uuid.uuid4().hex[:6]}",
        "messages": [{"role": "user", "content": "hi"}],
    }
    too_many = {**base, **{f"x{i}": 1 for i in range(MAX_UNKNOWN_FIELDS + 1)}}
    keys_500k = json.dumps({f"k{i}": 0 for i in range(500_000)}).encode()
    long_names = [json.dumps({**base, str(i) * 10_000_000: 1}).encode() for i in range(8)]
    with HealthWatch(g.url, "500k unique keys, 8 x 10 MB field names, 300 new names") as hw:
        status, err = _post(url, keys_500k)
        assert status == 400 and "500000 JSON values or more" in err["message"]
        for raw in long_names:
            status, err = _post(url, raw)
            assert status == 400 and "a field name of 10000000 characters" in err["message"]
        status, err = _post(url, json.dumps(too_many).encode())
        assert status == 400 and f"{MAX_UNKNOWN_FIELDS + 1} fields mlxq does not know" in str(err)
        for i in range(MAX_WARNED_NAMES + 44):  # each parsed, its field ignored: no such model
            status, err = _post(url, json.dumps({**base, f"new_{i}": 1}).encode())
            assert status == 404 and err["code"] == "model_not_found", err
    hw.check()
    log = g.output()
    # Remembered and told by name up to a bound, then once that no more are.
    assert log.count("ignoring request field '") == MAX_WARNED_NAMES
    assert log.count("no more are") == 1
    assert _longest_line(log) < 1_000 and "Traceback" not in log


@pytest.mark.e2e
def test_deep_json_and_lone_surrogates_are_400_naming_the_field(start_gateway):
    g = start_gateway()
    url = f"{g.url}/v1/chat/completions"
    msgs = '[{"role": "user", "content": "hi"}]'

    def body(extra: str, model: str = '"q"', messages: str = msgs) -> bytes:
        return f'{{"model": {model}, "messages": {messages}{extra}}}'.encode()

    deep = '{"a": ' * 40 + "1" + "}" * 40
    cases = [
        (body("", model='"\\ud800"'), "model"),
        (body("", messages='[{"role": "user", "content": "a\\udc00b"}]'), "messages[0].content"),
        (body(', "stop": ["ok", "\\ud83d"]'), "stop[1]"),
        (body(', "user": "\\udfff"'), "user"),
        (body(', "metadata": {"k": {"v": "\\ud800"}}'), "metadata.k.v"),
        (body(', "\\ud800": 1'), "\\ud800"),
        (body(f', "metadata": {deep}'), "metadata" + ".a" * 32),
        (body(', "x": ' + "[" * 900 + "]" * 900), "x" + "[0]" * 32),
        (b"[" * 5_000 + b"]" * 5_000, None),  # deeper than the decoder goes
    ]
    with HealthWatch(g.url, "deep JSON and lone surrogates") as hw:
        for raw, param in cases:
            status, err = _post(url, raw)
            assert status == 400, (raw[:80], err)
            assert err["param"] == (param if param is None else param[:80]), err
            assert "lone surrogate" in err["message"] or "deep" in err["message"], err
        # A surrogate pair is one character (an emoji): a body, not an error.
        status, err = _post(url, body(', "user": "\\ud83d\\ude00"'))
        assert status == 404 and err["code"] == "model_not_found", err
    hw.check()
    assert "Traceback" not in g.output()


def _serve(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "MLXQ_API_KEY"}
    return subprocess.run(
        [sys.executable, "-m", "mlxq.producer.cli", "serve", "--port", "0", *args],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["--api-key", ""], {}, "--api-key is empty"),
        ([], {"MLXQ_API_KEY": ""}, "$MLXQ_API_KEY is empty"),
        (["--api-key", " k-59d1"], {}, "--api-key has whitespace at an end"),
        (["--api-key", "k-59d1\t"], {}, "--api-key has whitespace at an end"),
        ([], {"MLXQ_API_KEY": "k-59d1 "}, "$MLXQ_API_KEY has whitespace at an end"),
        (["--api-key", "k\u00e9-59d1"], {}, "--api-key has a non-ASCII character at position 1"),
        (["--api-key", "k-59d1\x7f"], {}, "--api-key has a control character at position 6"),
    ],
)
def test_serve_refuses_api_keys_no_header_can_carry(args, env, says):
    out = _serve(*args, **env)
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert "59d1" not in out.stderr, "the key is a secret: never echoed"
    key = args[-1] if args else env["MLXQ_API_KEY"]
    with pytest.raises(ValueError, match="api_key"):
        GatewayConfig(api_key=key)


# -- hypothesis: random bytes through the real decode paths -----------------------------


class Unpickled(BaseException):
    """Raised if anything unpickles; a BaseException so no `except Exception` hides it."""


def _tripwire(*_: Any, **__: Any) -> Any:
    raise Unpickled("pickle was used to decode Redis data")


@contextlib.contextmanager
def no_pickle() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for name in ("loads", "load", "Unpickler", "_loads", "_load", "_Unpickler"):
            if hasattr(pickle, name):
                mp.setattr(pickle, name, _tripwire)
        # rq's default serializer bound pickle.loads at import: trip that too.
        mp.setattr(DefaultSerializer, "loads", _tripwire)
        yield


def test_the_pickle_tripwire_is_armed():
    pickled = RqJob(connection=redis.Redis(), serializer=None)  # rq's default: pickle
    pickled.func_name, pickled.args = keys.JOB_FUNC, ({"v": 1, "prompt": "hi"},)
    rq_job = RqJob(connection=redis.Redis(), serializer=None)
    rq_job.data = pickled.data
    with no_pickle():
        with pytest.raises(Unpickled):
            pickle.loads(pickle.dumps(1))
        with pytest.raises(Unpickled):
            _ = rq_job.func_name  # rq's own reading of a pickled job: the tripwire trips
    # The same bytes read the way the worker reads them: refused, never unpickled.
    with no_pickle(), pytest.raises(PayloadError, match="not mlxq msgpack"):
        decode_request(zlib.compress(pickled.data), max_tokens_cap=32_768)


INT64 = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
nasty = st.one_of(
    st.none(),
    st.booleans(),
    INT64,
    st.floats(),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 0.5, 1e300, 5e-324]),
    st.text(max_size=6),
    st.binary(max_size=6),
    st.lists(st.integers(-5, 5) | st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=4), INT64 | st.text(max_size=3), max_size=3),
)
message = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "root"]),
            "content": st.text(max_size=8) | nasty,
        }
    ),
    st.dictionaries(st.sampled_from(["role", "content", "name"]), nasty, max_size=3),
    nasty,
)
payloads = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 1, 1, 2, 0, True, 1.0, None, "1"])},
    optional={
        "prompt": st.text(max_size=8) | nasty,
        "messages": st.lists(message, max_size=3) | nasty,
        **{
            f: nasty
            for f in (
                "max_tokens",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "stop",
                "metadata",
                "timeout",
                "ttl",
                "extra",
            )
        },
    },
)

GOOD = {
    "prompt": st.text(min_size=1, max_size=8),
    "max_tokens": st.integers(1, 64),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50),
    "min_p": st.floats(0, 1),
    "seed": st.none() | st.integers(0, 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "metadata": st.none() | st.dictionaries(st.text(max_size=4), INT64, max_size=2),
    "timeout": st.none() | st.floats(0.5, 600),
    "ttl": st.none() | st.floats(0.5, 600),
}
#: Mostly well-formed payloads with the odd nasty value: these reach the accepting paths.
near_good = st.fixed_dictionaries(
    {"v": st.just(1), "prompt": GOOD["prompt"]},
    optional={f: st.one_of(g, g, g, nasty) for f, g in GOOD.items() if f != "prompt"},
)


def _flip(t: tuple[bytes, int, int]) -> bytes:
    data, at, byte = t
    if not data:
        return data
    i = at % len(data)
    return data[:i] + bytes([byte]) + data[i + 1 :]


packed = (payloads | near_good).map(MsgpackSerializer.dumps)
wire = st.one_of(
    st.binary(max_size=512),
    packed,
    near_good.map(MsgpackSerializer.dumps),
    st.tuples(packed, st.integers(0, 4096), st.integers(0, 255)).map(_flip),
    st.tuples(packed, st.integers(0, 4096)).map(lambda t: t[0][: t[1] % (len(t[0]) + 1)]),
)
RANDOM = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@RANDOM
@given(wire)
def test_random_bytes_decode_or_fail_cleanly_and_never_unpickle(data):
    with no_pickle():
        try:
            obj = MsgpackSerializer.loads(data)
        except ValueError:  # msgpack's own: ExtraData, FormatError, StackError, bad utf-8...
            return
        try:
            req = GenerationRequest.from_payload(obj)
        except PayloadError:
            event("refused by name")
            return
        event("accepted")
        # Accepted: it must survive the round trip the producer and worker make.
        assert (
            GenerationRequest.from_payload(
                MsgpackSerializer.loads(MsgpackSerializer.dumps(req.to_payload()))
            )
            == req
        )


job_tuples = st.tuples(
    st.sampled_from([keys.JOB_FUNC, "os.system", None, 1]),
    st.none() | nasty,
    st.lists(payloads | near_good, max_size=2) | nasty,
    st.just({}) | nasty,
).map(lambda t: MsgpackSerializer.dumps(list(t)))


@RANDOM
@given(st.one_of(wire, job_tuples, job_tuples.map(lambda b: _flip((b, len(b) // 2, 0xC1)))))
def test_worker_decode_job_on_random_job_data(data):
    """The worker's own path: the stored (compressed) job data, then decode_request."""
    with no_pickle(), contextlib.suppress(PayloadError):
        decode_request(zlib.compress(data), max_tokens_cap=32_768)
        decode_request(data, max_tokens_cap=32_768)
