"""MLX's own settings that a long-lived worker needs before its first evaluation.

MLX's CUDA backend keeps what it builds in caches of a few hundred entries: the CUDA graphs
of its passes (``MLX_CUDA_GRAPH_CACHE_SIZE``, 400, keyed by each graph's topology) and the
cuDNN attention plans of its prefills (``MLX_CUDA_SDPA_CACHE_SIZE``, 256, by shape). Each
counts its misses over the life of the process, and past twice its size every further miss
raises "Cache thrashing is happening" out of the evaluation that met it
(``MLX_ENABLE_CACHE_THRASHING_CHECK``, on by default; mlx 0.32's
``mlx/backend/cuda/lru_cache.h``). A worker runs for days and meets new batch and prompt
shapes as rows join and leave and prompts reuse cached prefixes, so the counts only grow;
the check would end in failed steps on a worker that had served well for hours. The worker
turns it off unless the operator set it (MLX's own test runner does the same); a thrashing
cache then costs time, not jobs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

from mlxq.worker.env import env_switch

log = logging.getLogger("mlxq.worker")

#: What the worker sets where the environment does not say.
DEFAULTS = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set each of :data:`DEFAULTS` that ``environ`` lacks (an operator's value stays);
    return those set. Before the first evaluation on the GPU, which reads them."""
    given = {k: v for k, v in DEFAULTS.items() if k not in environ}
    environ.update(given)
    return given


def log_given(given: dict[str, str]) -> None:
    """Say what :func:`apply_defaults` set, once the worker is past its start-up checks
    (each refusal is one line)."""
    for k, v in given.items():
        log.info("mlx: %s=%s (the worker's default; set it to choose)", k, v)


def on_cuda() -> bool:
    """Whether MLX runs on its CUDA backend here (where defaults that weigh a pass's cost
    differ)."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and mx.default_device().type == mx.gpu)


#: The share of MLX's memory limit its buffer cache may hold before a large pass gives it
#: back, where the cache is kept (``MLXQ_TRIM_CACHE=1``, :func:`trim_cache`).
CACHE_SHARE = 16
TRIM_ENV = "MLXQ_TRIM_CACHE"
#: Whether a large pass keeps MLX's cached buffers up to 1/:data:`CACHE_SHARE` of its
#: memory limit unless told (``MLXQ_TRIM_CACHE``): no, it clears them, as mlx-lm does.
KEEP_CACHE = False


def trim_cache() -> bool:
    """After a large pass (and every 512 decode steps), give MLX's cached buffers back;
    True if so. ``MLXQ_TRIM_CACHE=1`` keeps them until they pass 1/:data:`CACHE_SHARE`
    of its memory limit instead (``0``: clear, the default).

    Why clear, as mlx-lm does. A worker beside a sweep prefills a large refill every few
    seconds, and each clear frees every buffer the next decode steps allocate again: on
    an H100 that was 2.4% of a worker's decode thread (py-spy), so the worker once kept
    them. Measured side by side on an H100 (0.5B shape, three pairs of turns runs,
    docs/benchmarks.md), keeping them cost more than it saved: the steady decode step of
    62 rows took 7.40-7.72 ms kept against 6.56-7.32 cleared, the mlx-lm bookkeeping
    around a refill 26.2-30.1 ms against 4.7-4.9 (each run's mean), and the sweep made
    2-10% fewer decode steps in the same time, though the clears took 3.6 s more of each
    50 s run."""
    import mlx.core as mx

    keep = env_switch(TRIM_ENV, KEEP_CACHE)
    if keep and mx.get_cache_memory() * CACHE_SHARE <= mx.get_memory_limit():
        return False
    mx.clear_cache()
    return True
