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
#: back (:func:`trim_cache`).
CACHE_SHARE = 16
TRIM_ENV = "MLXQ_TRIM_CACHE"


def trim_cache() -> bool:
    """Give MLX's cached buffers back where they pass 1/:data:`CACHE_SHARE` of its memory
    limit; True if so.

    mlx-lm clears the cache after every large prefill and every 512 decode steps. A
    worker beside a sweep prefills a large refill every few seconds, and each clear frees
    every buffer the next decode steps allocate again: on an H100 a worker's decode thread
    spent 2.4% of its time freeing them (py-spy, docs/benchmarks.md). MLX itself gives
    cached buffers back when an allocation would pass its memory limit, so a bounded cache
    costs no room a pass needs. ``MLXQ_TRIM_CACHE=0`` clears it every time, as mlx-lm
    does, to compare the two on one machine."""
    import mlx.core as mx

    keep = os.environ.get(TRIM_ENV, "1").strip() != "0"
    if keep and mx.get_cache_memory() * CACHE_SHARE <= mx.get_memory_limit():
        return False
    mx.clear_cache()
    return True
