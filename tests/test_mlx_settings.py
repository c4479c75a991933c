"""MLX's settings a long-lived worker sets before its first evaluation
(:mod:`mlxq.worker.mlx_settings`)."""

from __future__ import annotations

import pytest

from mlxq.worker.mlx_settings import DEFAULTS, apply_defaults

CHECK = "MLX_ENABLE_CACHE_THRASHING_CHECK"


def test_the_thrashing_check_is_off_unless_the_operator_set_it():
    env: dict[str, str] = {}
    assert apply_defaults(env) == {CHECK: "0"} and env == {CHECK: "0"}
    assert apply_defaults(env) == {}  # set already: nothing again
    chosen = {CHECK: "1"}
    assert apply_defaults(chosen) == {} and chosen == {CHECK: "1"}
    assert set(DEFAULTS) == {CHECK}


def test_a_worker_sets_it_and_says_so(monkeypatch: pytest.MonkeyPatch, start_worker):
    monkeypatch.delenv(CHECK, raising=False)
    text = start_worker().output()
    assert f"mlx: {CHECK}=0 (the worker's default; set it to choose)" in text, text


def test_a_kept_cache_is_given_back_only_past_the_share(monkeypatch):
    import mlx.core as mx

    from mlxq.worker.mlx_settings import CACHE_SHARE, TRIM_ENV, trim_cache

    monkeypatch.setenv(TRIM_ENV, "1")  # keep the cache up to its share

    mx.clear_cache()
    limit = mx.get_memory_limit()
    try:
        x = mx.ones((256, 1024))  # 1 MiB of float32, cached once freed
        mx.eval(x)
        del x
        cached = mx.get_cache_memory()
        assert cached > 0
        mx.set_memory_limit(cached * CACHE_SHARE)  # the cache at its share: kept
        assert not trim_cache() and mx.get_cache_memory() == cached
        mx.set_memory_limit(cached * CACHE_SHARE - 1)  # past it: given back
        assert trim_cache() and mx.get_cache_memory() == 0
    finally:
        mx.set_memory_limit(limit)


def test_a_large_pass_clears_the_cache_unless_told_to_keep_it(monkeypatch):
    import mlx.core as mx

    from mlxq.worker.mlx_settings import KEEP_CACHE, TRIM_ENV, trim_cache

    assert KEEP_CACHE is False
    for given, kept in (("", False), ("0", False), ("1", True), ("yes", False)):
        monkeypatch.setenv(TRIM_ENV, given)
        mx.eval(mx.ones((256, 1024)))  # freed at once: cached
        assert mx.get_cache_memory() > 0
        # mlx-lm's way unless told: every large pass clears it; kept, a small cache stays.
        assert trim_cache() is not kept, given
        assert (mx.get_cache_memory() > 0) is kept, given
    mx.clear_cache()
