"""A worker's and the gateway's start-up heap is kept out of garbage collection."""

from __future__ import annotations

import subprocess
import sys

LINE = "start-up objects kept out of garbage collection"


def test_the_heap_alive_at_the_call_is_frozen_and_said():
    code = (
        "import gc, logging\n"
        "logging.basicConfig(level='INFO')\n"
        "from mlxq.producer.heap import freeze_startup_heap\n"
        "before = gc.get_freeze_count()\n"
        "n = freeze_startup_heap('test')\n"
        "print(before, n, gc.get_freeze_count(), len(gc.get_objects()))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    before, n, after, tracked = map(int, done.stdout.split())
    assert before == 0 and n == after > 1000
    assert tracked < n // 10  # what is left to walk is what came after
    assert f"test: {n} {LINE}" in done.stderr


def test_a_worker_and_the_gateway_freeze_theirs_before_they_serve(start_worker, start_gateway):
    w = start_worker()
    assert f"worker {w.name}: " in w.output() and LINE in w.output(), w.output()
    g = start_gateway().wait_ready()
    assert "gateway: " in g.output() and LINE in g.output(), g.output()


def test_a_slow_collection_is_logged_with_its_generation_and_a_quick_one_is_not():
    code = (
        "import gc, logging\n"
        "logging.basicConfig(level='INFO')\n"
        "from mlxq.producer.heap import watch_collections\n"
        "watch_collections('quick', slow_s=3600)\n"
        "watch_collections('test', slow_s=0.005)\n"
        "heap = [[i] for i in range(1_000_000)]\n"  # tracked objects for a full walk
        "gc.collect()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "test: garbage collection of generation 2 took " in done.stderr, done.stderr
    assert "quick:" not in done.stderr
