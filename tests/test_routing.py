"""Chat turns handed to the worker whose prompt cache holds their history (real workers,
real Redis, the tiny model), and every way a handed job can go wrong."""

from __future__ import annotations

import socket
import time
import urllib.request

import msgpack
import pytest

from mlxq.producer import Client, keys
from mlxq.worker.routing import Router

SYSTEM = "You answer in the words of the harbour. " + " ".join(
    f"rule {i}: the boats come home at dawn and the nets are mended by noon." for i in range(12)
)


def _chat(client: Client, turns: int) -> list[str]:
    """Run one chat turn by turn; the name of the worker that ran each turn."""
    messages = [{"role": "system", "content": SYSTEM}]
    ran = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"turn {turn}: what of the tide?"})
        job = client.submit(messages=messages, max_tokens=6, temperature=0)
        res = job.result(timeout=120)
        messages.append({"role": "assistant", "content": res.text})
        ran.append(client.redis.hget(keys.job_key(job.id), "worker_name").decode())
    return ran


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as res:
        text = res.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _stats(r, name: str) -> dict:
    raw = r.hget(keys.worker_stats_key(name), "stats")
    return msgpack.unpackb(raw) if raw else {}


def _until(check, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if v := check():
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("routing", [True, False])
def test_a_chats_turns_stay_on_the_worker_holding_its_history(
    redis_server, queue_name, start_worker, r, routing
):
    opts: dict = {} if routing else {"no_routing": True}
    ports = [_free_port(), _free_port()]
    a, b = (
        start_worker(max_batch=8, metrics_port=p, metrics_host="127.0.0.1", **opts) for p in ports
    )
    client = Client(redis_server.url, queue=queue_name)
    ran = _chat(client, 6)
    # Two idle workers take queued jobs in turn (Redis serves the longest blocked first),
    # so without routing a chat's turns alternate between them.
    if not routing:
        assert len(set(ran)) == 2, ran
        return
    assert ran == [ran[0]] * 6, ran
    holder = ran[0]
    other = b.name if holder == a.name else a.name
    stats = _until(lambda: (s := _stats(r, holder)) and s["jobs_finished"] == 6 and s, "stats")
    assert stats["prompt_cache_hits"] >= 5 and stats["jobs_handed_in"] >= 1
    # The other worker was handed turns (it woke first) and passed each on.
    assert _until(lambda: _stats(r, other).get("jobs_handed_out"), "the other's stats") >= 1
    out, into = (
        sum(_scrape(p)[f"mlxq_jobs_handed_{k}_total"] for p in ports) for k in ("out", "in")
    )
    assert out == into >= 1


def test_chat_turns_on_a_lower_level_queue_follow_their_history(
    redis_server, queue_name, start_worker, r
):
    hi = f"hi-{queue_name}"
    for _ in range(2):
        start_worker([hi, queue_name], max_batch=8)
    ran = _chat(Client(redis_server.url, queue=queue_name), 6)
    assert ran == [ran[0]] * 6, ran
    assert r.zcard(f"rq:finished:{queue_name}") == 6 and r.zcard(f"rq:finished:{hi}") == 0


# -- the hand-off's scripts, driven step by step on two workers' bridges ---------------


@pytest.fixture
def bridges(redis_server, queue_name, tmp_path):
    """Two registered worker bridges on the queue (no decode loop: each step by hand)."""
    from mlxq.worker.bridge import Bridge
    from mlxq.worker.config import WorkerConfig

    made = []
    for i in range(2):
        config = WorkerConfig(
            str(tmp_path), redis_url=redis_server.url, queue=queue_name, name=f"b{i}-{queue_name}"
        )
        made.append(Bridge(config))
        made[-1].register()
    yield made
    for b in made:
        b.unregister(settled=True)


TURN = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "and then?"},
]


def _turn(client: Client) -> object:
    return client.submit(messages=TURN, max_tokens=4)


def _room(r, name: str, room: object, load: int = 0) -> None:
    """What a worker's stats say of it: free rows, and rows held."""
    r.hset(keys.worker_stats_key(name), mapping={"room": room, "load": load})


def _claimed_by(b, job) -> object:
    (c,) = b.claim(1)
    assert c.verdict == "ok" and c.id.decode() == job.id
    return c


@pytest.fixture
def claimed(bridges, redis_server, queue_name):
    """Two bridges ``to`` and ``by``, a client, and a chat turn ``by`` claimed."""
    to, by = bridges
    client = Client(redis_server.url, queue=queue_name)
    job = _turn(client)
    _claimed_by(by, job)
    return to, by, client, job


@pytest.fixture
def handed(claimed, r):
    """The same, the turn handed to ``to``."""
    to, by, _, job = claimed
    _room(r, to.name, 1)
    assert Router(by).hand(job.id, to.name, 8) == "ok"
    return claimed


def test_a_job_is_handed_only_to_a_live_worker_with_room_and_only_once(claimed, queue_name, r):
    to, by, _, job = claimed
    _room(r, to.name, 0)
    assert Router(by).hand(job.id, to.name, 8) == "full"
    _room(r, to.name, "junk")
    assert Router(by).hand(job.id, to.name, 8) == "full"
    r.delete(keys.worker_stats_key(to.name))
    r.rpush(keys.worker_stats_key(to.name), "rogue")
    assert Router(by).hand(job.id, to.name, 8) == "full"
    r.delete(keys.worker_stats_key(to.name))
    # Busy by what it holds now (its WIP list), not by its stats, a second old at most:
    # a worker that just ended the turns handed to it holds nothing, whatever they say.
    _room(r, to.name, 3, load=9)
    r.rpush(keys.wip_key(to.name), *[f"held-{i}" for i in range(9)])
    assert Router(by).hand(job.id, to.name, 8) == "busy"
    r.delete(keys.wip_key(to.name))
    _room(r, to.name, 0, load=3)  # three rows, and its WIP list holds three: full
    r.rpush(keys.wip_key(to.name), *[f"held-{i}" for i in range(3)])
    assert Router(by).hand(job.id, to.name, 8) == "full"
    r.delete(keys.wip_key(to.name))
    r.set(keys.handed_key(to.name), "rogue")
    _room(r, to.name, 3, load=8)
    assert Router(by).hand(job.id, to.name, 8) == "keys"
    r.delete(keys.handed_key(to.name))
    assert Router(by).hand(job.id, "nobody", 8) == "gone"
    assert Router(by).hand(job.id, by.name, 8) == "gone"
    r.srem(keys.workers_key(queue_name), to.name)  # live, but serving another queue
    assert Router(by).hand(job.id, to.name, 8) == "gone"
    r.sadd(keys.workers_key(queue_name), to.name)
    assert Router(by).hand(job.id, to.name, 8) == "ok"
    assert to.wip() == [job.id.encode()] and not by.wip()
    stats = r.hgetall(keys.worker_stats_key(to.name))  # one row less, one job more
    assert stats[b"room"] == b"2" and stats[b"load"] == b"9"
    assert r.hget(keys.job_key(job.id), "mlxq_owner") is None
    assert Router(by).hand(job.id, to.name, 8) == "job"  # not the hander's any more
    (c,) = to.claim(1)
    assert c.verdict == "ok" and c.handed and c.id.decode() == job.id
    assert r.zcard(keys.handed_key(to.name)) == 0
    _room(r, by.name, 1)
    assert Router(to).hand(job.id, by.name, 8) == "job"  # handed once, never on


def test_a_handed_job_left_unclaimed_goes_back_to_the_queue_front(
    handed, redis_server, queue_name, r
):
    from mlxq.worker.bridge import HAND_GRACE_MS

    to, by, client, job = handed
    behind = client.submit("behind it", max_tokens=2)
    assert to.beat() == "ok" and to.wip() == [job.id.encode()]  # within the grace: kept
    time.sleep(HAND_GRACE_MS / 1000 + 0.1)
    assert to.beat() == "ok"
    assert not to.wip() and r.zcard(keys.handed_key(to.name)) == 0
    assert r.lrange(keys.queue_key(queue_name), 0, -1) == [job.id.encode(), behind.id.encode()]
    (c,) = by.claim(1)  # whoever claims it now runs it: it is never handed again
    assert c.handed and c.id.decode() == job.id
    assert Router(by).hand(job.id, to.name, 8) == "job"


def test_a_handed_job_canceled_before_it_is_claimed_ends_canceled(
    handed, redis_server, queue_name, r
):
    to, _by, _client, job = handed
    assert job.cancel() is True
    (c,) = to.claim(1)
    assert c.verdict == "canceled" and job.status() == "canceled" and not to.wip()
    assert [c.finish_reason for c in job.stream(timeout=10)][-1] == "canceled"


def test_a_worker_that_dies_holding_a_handed_job_has_it_run_elsewhere(
    handed, redis_server, queue_name, start_worker, r
):
    to, _by, _client, job = handed
    r.delete(keys.alive_key(to.name))  # its lease ran out: dead
    start_worker()  # reaps the dead one at its first heartbeat: the job runs here
    assert job.result(timeout=60).finish_reason in ("stop", "length")
    assert not to.wip()


def test_a_graceful_stop_gives_back_what_was_handed_and_not_claimed(
    handed, redis_server, queue_name, r
):
    to, by, client, job = handed
    assert to.unregister(settled=True) == 1
    assert r.lrange(keys.queue_key(queue_name), 0, -1) == [job.id.encode()]
    assert not to.wip() and not r.sismember(keys.workers_key(queue_name), to.name)
    # Gone in the same script: no hand lands on it after (one that did would be stranded,
    # in the list of a worker no reaper looks at).
    other = _turn(client)
    _claimed_by(by, job)
    _claimed_by(by, other)
    _room(r, to.name, 1)
    assert Router(by).hand(other.id, to.name, 8) == "gone"


def test_a_worker_that_stops_holding_a_job_stays_on_the_roll_for_the_reaper(
    handed, redis_server, queue_name, r
):
    to, _by, _client, job = handed
    _claimed_by(to, job)
    assert to.unregister(settled=True) == 0  # claimed: its own now, not given back
    assert r.sismember(keys.workers_key(queue_name), to.name)
    assert r.get(keys.alive_key(to.name)) is None and to.wip() == [job.id.encode()]


def test_a_job_given_back_is_not_claimed_by_a_stale_read_of_the_list(
    handed, redis_server, queue_name, r
):
    from mlxq.worker.bridge import HAND_GRACE_MS

    to, by, _client, job = handed
    stale = to.wip()  # the prefetch thread reads its list...
    time.sleep(HAND_GRACE_MS / 1000 + 0.1)
    assert to.beat() == "ok"  # ...the heartbeat gives the job back meanwhile...
    (c,) = to.claim(0, stale)  # ...and the claim of what it read must not take it
    assert c.verdict == "missing"
    assert r.hget(keys.job_key(job.id), "mlxq_owner") is None
    (c,) = by.claim(1)  # whoever claims it from the queue runs it
    assert c.verdict == "ok" and c.id.decode() == job.id and by.wip() == [job.id.encode()]


def test_a_hand_whose_reply_is_lost_is_not_run_on_a_guess(bridges, redis_server, queue_name, r):
    import redis as redis_py

    from mlxq.producer.params import GenerationRequest
    from mlxq.worker.routing import continues

    to, by = bridges
    client = Client(redis_server.url, queue=queue_name)
    job = _turn(client)
    (c,) = by.claim(1)
    req = GenerationRequest(messages=TURN)
    r.set(continues(queue_name, req), to.name)  # ``to`` made the last reply
    _room(r, to.name, 4)
    router = Router(by)
    real_hand = router.hand

    def hand_then_lose_reply(*a):
        real_hand(*a)
        raise redis_py.ConnectionError("connection reset")

    router.hand = hand_then_lose_reply  # type: ignore[method-assign]
    out = router.hand_off([(job.id, c, req)], 0)
    assert out.kept == []  # not kept to run here...
    assert out.unsure  # ...the WIP list, looked over next, says whose it is
    assert not by.wip() and to.wip() == [job.id.encode()]


def test_rogue_routing_keys_never_stop_a_chat(redis_server, queue_name, start_worker, r):
    a, b = start_worker(max_batch=4), start_worker(max_batch=4)
    client = Client(redis_server.url, queue=queue_name)
    messages = [{"role": "system", "content": SYSTEM}]
    from mlxq.worker.routing import conversation_key

    for turn, rogue in enumerate(["none", "hash", "name", "dead", "handed", "blocker"]):
        if rogue != "none":
            route = conversation_key(queue_name, messages)
            if rogue == "hash":
                r.delete(route)
                r.hset(route, "x", "y")
            elif rogue == "name":
                r.set(route, "no such: worker\n" * 20)
            elif rogue == "dead":
                r.set(route, "w9-dead")
            else:
                holder = r.get(route).decode()
                k = {"handed": keys.handed_key(holder), "blocker": keys.blocker_key(holder)}[rogue]
                r.delete(k)
                r.rpush(k, "x")
        messages.append({"role": "user", "content": f"turn {turn}: and the tide?"})
        res = client.submit(messages=messages, max_tokens=4).result(timeout=60)
        messages.append({"role": "assistant", "content": res.text})
    assert a.proc.poll() is None and b.proc.poll() is None
    assert "Traceback" not in a.output() + b.output()


def test_a_worker_whose_acl_denies_client_commands_still_serves_and_takes_handed_turns(
    redis_server, queue_name, start_worker, r
):
    # Wake-ups use CLIENT ID and CLIENT UNBLOCK; a Redis user without them loses only those.
    user = f"noclient-{queue_name}"
    r.execute_command(
        "ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all", "-client|id", "-client|unblock"
    )
    try:
        url = redis_server.url.replace("redis://", f"redis://{user}:pw@")
        a = start_worker(max_batch=8, redis_url=url)
        b = start_worker(max_batch=8, redis_url=url)
        client = Client(redis_server.url, queue=queue_name)
        ran = _chat(client, 4)
        assert ran == [ran[0]] * 4, ran
        for w in (a, b):
            assert w.output().count("routing: cannot name") <= 1
            assert "Traceback" not in w.output()
    finally:
        r.execute_command("ACL", "DELUSER", user)
