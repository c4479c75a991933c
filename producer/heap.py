"""The start-up heap of a long-running mlxq process (a worker, the gateway), kept out of
the cyclic collector's walk."""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect once, then move every object alive now out of the collector's reach
    (``gc.freeze``): imported modules, the model's and tokenizer's objects, what the
    warm-up left. A full collection otherwise walks them all with the GIL held, a pause
    of every thread (a worker's decode thread, and so every row of its batch) each time
    one runs; as vLLM does with its engine's and API server's start-up heaps. Objects
    made later are collected as before.

    Returns:
        How many objects are frozen.
    """
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    ms = (time.perf_counter() - start) * 1e3
    log.info("%s: %d start-up objects kept out of garbage collection (%.0f ms)", what, frozen, ms)
    return frozen


#: A collection this long (s) is logged: every thread of the process waited for it.
SLOW_COLLECTION_S = 0.1


def watch_collections(what: str, slow_s: float = SLOW_COLLECTION_S) -> None:
    """Log each garbage collection that takes ``slow_s`` or more, with its generation and
    what it found: the collector holds the GIL, so a long one stalls every thread at once
    (a worker's decode thread and its claims alike), and the log says it was the collector
    and not the device. Costs two clock reads a collection."""
    started: list[float] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
            return
        if not started:
            return
        took = time.perf_counter() - started.pop()
        if took >= slow_s:
            log.warning(
                "%s: garbage collection of generation %d took %.0f ms (%d objects "
                "collected, %d uncollectable)",
                what,
                info.get("generation", -1),
                1000 * took,
                info.get("collected", 0),
                info.get("uncollectable", 0),
            )

    gc.callbacks.append(note)
