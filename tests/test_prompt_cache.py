"""The prompt cache: outputs never change, hits are counted, the byte budget holds, and a
canceled job, a restart or a model whose cache cannot merge break nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from mlxq.producer import Client, JobFailed
from mlxq.producer.params import GenerationRequest, SamplingParams

mlx_lm = pytest.importorskip("mlx_lm")

from mlxq.worker.engine import Engine  # noqa: E402
from mlxq.worker.jobs import Job, apply_deltas  # noqa: E402
from mlxq.worker.prompt_cache import MIN_REUSE, PromptCache, shared_prefixes  # noqa: E402

#: About 1,000 tokens of the tiny model's tokenizer, shared by every job below.
PREFIX = "Answer as the examples do. " + " ".join(f"example {i}: the harbour" for i in range(90))
QUESTIONS = [f" Question {i}: where do the boats go at dawn?" for i in range(6)]


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return mlx_lm.load(str(tiny_model))


def _started(engine: Engine, reqs: list[GenerationRequest]) -> list[Job]:
    """The requests as jobs started on ``engine``, ready to add."""
    jobs = []
    for i, req in enumerate(reqs):
        job = Job(f"j{i}", req, engine.encode(req))
        job.start("exec")
        jobs.append(job)
    return jobs


def _run(engine: Engine, reqs: list[GenerationRequest], *, at_once: int) -> list[list[int]]:
    """Run requests to the end, admitting ``at_once`` whenever rows are free."""
    jobs = _started(engine, reqs)
    pending = list(jobs)
    while pending or engine.active:
        if pending and engine.free_slots:
            n = min(at_once, engine.free_slots)
            engine.add(pending[:n])
            pending = pending[n:]
        apply_deltas(engine.step())
    return [j.token_ids for j in jobs]


def _sweep(seeded: bool, n: int = 12) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            prompt=PREFIX + QUESTIONS[i % len(QUESTIONS)] + f" ({i})",
            max_tokens=8,
            sampling=SamplingParams(temperature=0.9, seed=i) if seeded else SamplingParams(),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("at_once", [1, 4])
def test_outputs_are_the_same_with_and_without_the_cache(loaded, seeded, at_once):
    """One job at a time (each finds the last one's entry), and bursts of four (whose
    shared prefix is prefilled once, before its rows)."""
    reqs = _sweep(seeded)
    plain = Engine(*loaded, max_batch=at_once, prompt_cache_bytes=0)
    cached = Engine(*loaded, max_batch=at_once, prompt_cache_bytes=1 << 30)
    assert _run(cached, reqs, at_once=at_once) == _run(plain, reqs, at_once=at_once)
    c, p = cached.counters, plain.counters
    assert p.prompt_cache_queries == p.prompt_cache_hits == 0
    assert p.prompt_tokens_prefilled == p.prompt_tokens
    assert c.prompt_cache_queries == len(reqs)
    # One at a time, the first job misses; a burst shares its prefix from the start.
    assert c.prompt_cache_hits == len(reqs) - (at_once == 1)
    assert c.prompt_tokens_cached > (len(reqs) - 1) * 400
    assert c.prompt_tokens_prefilled < p.prompt_tokens_prefilled / 5
    assert 0 < cached.prompt_cache_bytes <= 1 << 30


def test_choices_penalties_and_logprobs_are_the_same_with_and_without_the_cache(loaded):
    """What reads a row's whole prompt beyond its cache: n seeded choices of one prompt
    (its prefix prefilled once for all), penalties over the prompt's tokens, a logit bias
    and top log-probs; with a hit, the cached part of the prompt is still counted."""
    from mlxq.producer.logits_params import LogitsParams

    def reqs() -> list[GenerationRequest]:
        return [
            GenerationRequest(
                prompt=PREFIX + QUESTIONS[i],
                max_tokens=8,
                n=2,
                sampling=SamplingParams(temperature=0.9, seed=11 + i),
                logprobs=True,
                top_logprobs=3,
                logits=LogitsParams(
                    repetition_penalty=1.3, presence_penalty=0.5, logit_bias={17: 2.0}
                ),
            )
            for i in range(3)
        ]

    def run(engine: Engine) -> list[tuple[list[list[int]], list]]:
        jobs = _started(engine, reqs())
        for at_once in ([jobs[0]], jobs[1:]):  # one alone (it stores), then a burst (hits)
            engine.add(at_once)
            while engine.active:
                apply_deltas(engine.step())
        return [([c.token_ids for c in j.choices], [c.logprobs for c in j.choices]) for j in jobs]

    plain = Engine(*loaded, max_batch=8, prompt_cache_bytes=0)
    cached = Engine(*loaded, max_batch=8, prompt_cache_bytes=1 << 30)
    got, want = run(cached), run(plain)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        for x, y in zip(a, b, strict=True):
            assert [t["token"] for t in x] == [t["token"] for t in y]
            assert [t["logprob"] for t in x] == pytest.approx([t["logprob"] for t in y], abs=1e-4)
    assert cached.counters.prompt_cache_hits >= 4


def test_a_burst_of_hits_on_two_entries_and_misses_decodes_as_without_the_cache(loaded):
    """Rows on two different cached prefixes and rows with nothing cached, admitted
    together with a miss first: the batch is merged by the cache's block merge."""
    other = "Reply in the style below. " + " ".join(f"note {i}: the quay" for i in range(80))
    warm = [PREFIX + QUESTIONS[0], other + QUESTIONS[1]]
    burst = [
        "Where do the gulls sleep?",
        PREFIX + QUESTIONS[2],
        other + QUESTIONS[3] + " Say more.",
        "What rings the bell in fog?",
        PREFIX + QUESTIONS[4] + " And why?",
    ]

    def run(engine: Engine) -> list[list[int]]:
        out = _run(engine, [GenerationRequest(prompt=p, max_tokens=8) for p in warm], at_once=1)
        before = engine.counters.prompt_cache_hits
        reqs = [GenerationRequest(prompt=p, max_tokens=8) for p in burst]
        out += _run(engine, reqs, at_once=len(burst))
        assert engine.counters.prompt_cache_hits - before == (3 if engine.prompt_cache else 0)
        return out

    plain = Engine(*loaded, max_batch=8, prompt_cache_bytes=0)
    cached = Engine(*loaded, max_batch=8, prompt_cache_bytes=1 << 30)
    assert run(cached) == run(plain)


def test_a_finished_rows_view_is_what_mlx_lm_extracts(loaded):
    """Rows of four lengths (so four left paddings) mid-decode: each row's view, its
    padding known from its token count, holds what mlx-lm's copying extract holds; and
    rows packed together (the whole batch, some of it, two) hold what each packs alone."""
    import mlx.core as mx

    from mlxq.worker.kv_pack import packed, packed_rows

    engine = Engine(*loaded, max_batch=4, prompt_cache_bytes=1 << 30)
    prompts = [PREFIX[:350], PREFIX[:900], "Gulls " * 140, PREFIX[:600]]  # >= MIN_REUSE tokens
    engine.add(_started(engine, [GenerationRequest(prompt=p, max_tokens=20) for p in prompts]))
    for _ in range(4):
        apply_deltas(engine.step())
    batch = engine._gen._generation_batch
    assert len(batch) == 4 and len({len(t) for t in batch.tokens}) == 4
    for i in range(4):
        views = batch.extract_cache(i)
        for view, c in zip(views, batch.prompt_cache, strict=True):
            want = c.extract(i)
            assert view.offset == want.offset == len(batch.tokens[i])
            assert mx.array_equal(view.keys, want.keys).item()
            assert mx.array_equal(view.values, want.values).item()
    alone = [packed([c.extract(i) for c in batch.prompt_cache]) for i in range(4)]
    for rows in ([0, 1, 2, 3], [3, 0, 2], [1, 3]):
        together = packed_rows([batch.extract_cache(i) for i in rows])
        for i, block in zip(rows, together, strict=True):
            assert block is not None and block.shape == alone[i].shape
            assert mx.array_equal(block, alone[i]).item()


def test_a_chat_turn_reuses_the_last_turns_prompt_and_reply(loaded):
    engine = Engine(*loaded, max_batch=4, prompt_cache_bytes=1 << 30)
    first = GenerationRequest(prompt=PREFIX, max_tokens=12)
    (reply,) = _run(engine, [first], at_once=1)
    before = engine.counters.prompt_tokens_cached
    turn = engine.encode(first) + reply + engine.encode(GenerationRequest(prompt=" And then?"))
    job = Job("turn2", GenerationRequest(prompt="x", max_tokens=6), turn)
    job.start("exec")
    engine.add([job])
    while engine.active:
        apply_deltas(engine.step())
    # The reply's last token was never fed to the model: it is the one token left over.
    assert engine.counters.prompt_tokens_cached - before >= len(turn) - 20
    # The rest's pass attends to the cached turn too (a prefill shape counts its keys).
    rest = [(n, k) for _, n, k in engine.counters.prefill_shapes if k > n]
    assert rest and all(k >= len(turn) - 1 for _, k in rest), engine.counters.prefill_shapes
    plain = Engine(*loaded, max_batch=4, prompt_cache_bytes=0)
    again = Job("turn2", GenerationRequest(prompt="x", max_tokens=6), turn)
    again.start("exec")
    plain.add([again])
    while plain.active:
        apply_deltas(plain.step())
    assert job.token_ids == again.token_ids


def test_a_tiny_budget_evicts_and_changes_nothing(loaded):
    reqs = [
        GenerationRequest(prompt=f"{i} " + PREFIX[: 600 + 120 * i], max_tokens=6) for i in range(5)
    ]
    probe = Engine(*loaded, max_batch=1, prompt_cache_bytes=1 << 30)
    _run(probe, reqs[:1], at_once=1)
    one = probe.prompt_cache_bytes
    budget = int(one * 2.5)
    small = Engine(*loaded, max_batch=1, prompt_cache_bytes=budget)
    plain = Engine(*loaded, max_batch=1, prompt_cache_bytes=0)
    twice = reqs + reqs[::-1]  # the second round finds what the budget kept last
    assert _run(small, twice, at_once=1) == _run(plain, twice, at_once=1)
    assert 0 < small.prompt_cache_bytes <= budget
    assert small.prompt_cache is not None and len(small.prompt_cache) <= 2
    assert 0 < small.counters.prompt_cache_hits < len(reqs)


def test_a_removed_row_leaves_no_entry_and_the_next_job_is_right(loaded):
    engine = Engine(*loaded, max_batch=4, prompt_cache_bytes=1 << 30)
    req = GenerationRequest(prompt=PREFIX + QUESTIONS[0], max_tokens=200)
    job = Job("canceled", req, engine.encode(req))
    job.start("exec")
    engine.add([job])
    for _ in range(3):
        apply_deltas(engine.step())
    engine.remove([job])
    assert engine.active == 0 and engine.prompt_cache_bytes == 0
    short = GenerationRequest(prompt=PREFIX + QUESTIONS[0], max_tokens=8)
    plain = Engine(*loaded, max_batch=4, prompt_cache_bytes=0)
    assert _run(engine, [short], at_once=1) == _run(plain, [short], at_once=1)


def test_reset_empties_the_cache(loaded):
    engine = Engine(*loaded, max_batch=4, prompt_cache_bytes=1 << 30)
    _run(engine, _sweep(False, 2), at_once=1)
    assert engine.prompt_cache_bytes > 0
    engine.reset()
    assert engine.prompt_cache_bytes == 0
    assert _run(engine, _sweep(False, 2), at_once=1) == _run(
        Engine(*loaded, max_batch=4, prompt_cache_bytes=0), _sweep(False, 2), at_once=1
    )


@pytest.mark.parametrize(("window", "at_once"), [(4096, 1), (600, 4)])
def test_a_sliding_window_model_gives_the_same_outputs(tiny_model, window, at_once):
    """A model whose layers keep a rotating (sliding-window) KV cache, as Gemma 3's and
    Mistral's do: a window wider than the prompts (hits cut back from longer entries) and
    one the ~1,000-token prefix has already rotated (a burst's shared prefix, hit whole;
    a rotated entry cannot be cut back, so one job at a time would miss)."""
    from mlx_lm.models.cache import RotatingKVCache

    model, tok = mlx_lm.load(str(tiny_model))  # its own copy: make_cache is replaced
    model.make_cache = lambda: [RotatingKVCache(max_size=window, keep=4) for _ in model.layers]
    reqs = _sweep(False)
    plain = Engine(model, tok, max_batch=at_once, prompt_cache_bytes=0)
    cached = Engine(model, tok, max_batch=at_once, prompt_cache_bytes=1 << 30)
    assert _run(cached, reqs, at_once=at_once) == _run(plain, reqs, at_once=at_once)
    assert cached.counters.prompt_cache_hits >= len(reqs) - 1


def test_a_cache_that_cannot_merge_is_a_miss_never_an_error(loaded):
    from mlx_lm.models.cache import QuantizedKVCache

    model, _ = loaded

    class Quantized:
        layers = model.layers

        def make_cache(self):
            return [QuantizedKVCache() for _ in model.layers]

    pc = PromptCache(Quantized(), 1 << 20)
    assert not pc.mergeable
    assert pc.prefill_shared([[1] * 64 + [2], [1] * 64 + [3]]) == 0
    pc.store([1, 2, 3], Quantized().make_cache())
    assert pc.fetch([1, 2, 3, 4]) == (None, 0) and pc.nbytes == 0


def _prefilled(model, tokens: list[int]) -> list:
    """The KV cache of ``tokens``, prefilled alone."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_a_lookup_takes_the_longest_shared_prefix_and_never_a_short_one(loaded):
    import mlx.core as mx

    model, _ = loaded
    pc = PromptCache(model, 1 << 30)
    t = list(range(20, 620))
    other = list(range(700, 740))
    pc.store(t[:400], _prefilled(model, t[:400]))
    assert len(pc) == 1 and pc.nbytes > 0
    short = list(range(800, 800 + MIN_REUSE - 1))
    pc.store(short, _prefilled(model, short))  # could never serve a hit: not kept
    assert len(pc) == 1
    # An entry that is a prefix of the prompt; the prompt itself (cut by one, so a token
    # is left to prefill); an entry sharing only the first 240 tokens, cut back to them.
    for tokens, want in [(t[:600], 400), (t[:400], 399), (t[:240] + other, 240)]:
        cache, held = pc.fetch(tokens)
        assert held == want, tokens
        assert cache is not None and all(c.offset == want for c in cache)
        ref = _prefilled(model, t[:want])
        for c, r in zip(cache, ref, strict=True):
            k, v = c.state[:2]
            assert mx.allclose(k[..., :want, :], r.keys[..., :want, :], atol=1e-4).item()
            assert mx.allclose(v[..., :want, :], r.values[..., :want, :], atol=1e-4).item()
    # Fewer shared tokens than MIN_REUSE: a miss, as is a prompt that short.
    assert pc.fetch(t[: MIN_REUSE - 1] + other) == (None, 0)
    assert pc.fetch(t[:MIN_REUSE]) == (None, 0)
    assert pc.fetch(other + t) == (None, 0)


def test_decoding_from_a_hit_leaves_the_entry_as_it_was(loaded):
    import mlx.core as mx

    model, _ = loaded
    pc = PromptCache(model, 1 << 30)
    t = list(range(20, 420))
    pc.store(t, _prefilled(model, t))
    before, _ = pc.fetch([*t, 5])
    assert before is not None
    keys = [mx.array(c.keys) for c in before]
    cache, held = pc.fetch([*t[:280], 7, 8, 9])
    assert held == 280 and cache is not None
    model(mx.array([[7, 8, 9]]), cache=cache)  # writes past 280, where the entry has t[280:]
    model(mx.array([[10]]), cache=cache)
    mx.eval([c.state for c in cache])
    after, _ = pc.fetch([*t, 5])
    assert after is not None
    assert all(mx.array_equal(k, c.keys).item() for k, c in zip(keys, after, strict=True))


@pytest.mark.parametrize("together", [False, True])
def test_a_stored_row_holds_its_own_memory_not_its_batchs(loaded, together):
    """A finished row's cache is a slice of the whole batch's KV buffer until evaluated:
    kept lazy, every entry would pin a batch buffer the byte budget never counts. Rows
    finishing one at a time, and all at once (copied out of one stacked array)."""
    import gc

    import mlx.core as mx

    reqs = [
        GenerationRequest(
            prompt=f"{i} " + PREFIX + QUESTIONS[i % 6], max_tokens=40 if together else 40 + 20 * i
        )
        for i in range(16)
    ]
    engine = Engine(*loaded, max_batch=16, prompt_cache_bytes=1 << 34)
    mx.synchronize()
    gc.collect()
    base = mx.get_active_memory()
    _run(engine, reqs, at_once=16)
    engine._gen = None  # the batch and its buffers go; the entries stay
    gc.collect()
    mx.synchronize()
    held = mx.get_active_memory() - base
    assert engine.prompt_cache is not None and len(engine.prompt_cache) >= 8
    assert held < 1.5 * engine.prompt_cache_bytes + (8 << 20), (held, engine.prompt_cache_bytes)


def test_cached_rows_merge_into_the_batch_as_mlx_lm_merges_them(loaded):
    """Rows on one entry at one length (the broadcast), rows from one entry at two lengths
    and from two entries (the packed blocks), and a cached row beside a fresh one (mlx-lm's
    merge): each gives, layer by layer, the state mlx-lm's merge gives for plain copies."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

    model, _ = loaded
    pc = PromptCache(model, 1 << 30)
    t, u = list(range(20, 420)), list(range(500, 860))
    pc.store(t, _prefilled(model, t))
    pc.store(u, _prefilled(model, u))
    rows = [pc.fetch([*t[:320], 900 + i, 7])[0] for i in range(3)]  # one entry, 320 tokens
    odd = pc.fetch([*t[:240], 9, 9])[0]  # the same entry, shorter
    other = pc.fetch([*u[:280], 9, 9])[0]  # another entry
    fresh = _prefilled(model, list(range(950, 990)))
    empty = make_prompt_cache(model)  # a miss beside hits
    assert all(r is not None for r in [*rows, odd, other])

    def plain(c):
        k = KVCache()
        if c.keys is None:
            return k
        k.keys = mx.array(c.keys[..., : c.offset, :])
        k.values = mx.array(c.values[..., : c.offset, :])
        k.offset = c.offset
        return k

    groups = [
        [rows[0], rows[1], rows[2]],
        [rows[0], odd, rows[1]],
        [other, rows[2], odd, other],
        [rows[1], fresh],
        [other, empty, rows[0], empty],
    ]
    for group in groups:
        merged = [type(group[0][i]).merge([g[i] for g in group]) for i in range(len(model.layers))]
        for layer, got in enumerate(merged):
            want = BatchKVCache.merge([plain(g[layer]) for g in group])
            assert got._idx == want._idx
            assert mx.array_equal(got.left_padding, want.left_padding).item()
            assert mx.array_equal(got.offset, want.offset).item()
            for a, b in zip(got.keys_and_values(), want.keys_and_values(), strict=True):
                assert mx.array_equal(a, b).item()


def test_the_default_budget_is_a_quarter_of_what_the_model_leaves():
    from mlxq.worker.prompt_cache import CPU_DEFAULT_BYTES, budget_beside

    gib = 1 << 30
    metal = {"max_recommended_working_set_size": 16 * gib, "memory_size": 24 * gib}
    assert budget_beside(metal, 4 * gib) == 3 * gib  # the working set, not all memory
    assert budget_beside({"total_memory": 140 * gib}, 40 * gib) == 25 * gib  # CUDA
    assert budget_beside(metal, 16 * gib - (400 << 20)) == 100 << 20
    assert budget_beside(metal, 16 * gib - (200 << 20)) == 0  # 50 MiB: no cache
    assert budget_beside(metal, 20 * gib) == 0  # a model past the working set
    assert budget_beside({}, 0) == CPU_DEFAULT_BYTES  # no size given


def test_the_radix_tree_finds_what_a_scan_of_every_entry_finds():
    """Random adds and removals over a small alphabet (so edges split and fold often):
    the tree's nearest entries agree with a scan of every entry."""
    import random

    from mlxq.worker.prefix_tree import Entry, Trie

    rng = random.Random(7)
    trie, live = Trie(), {}

    def common(a, b):
        return next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )

    for _ in range(3000):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
        if rng.random() < 0.35 and live:
            gone = rng.choice(list(live))
            trie.remove(list(gone))
            del live[gone]
        elif rng.random() < 0.6:
            e = Entry(tokens, 0, None, [])
            prev, above = trie.add(e)
            assert prev is live.get(tuple(tokens))
            assert {tuple(a.tokens) for a in above} == {
                k for k in live if len(k) < len(tokens) and tuple(tokens[: len(k)]) == k
            }
            live[tuple(tokens)] = e
        prefix, plen, longer, shared = trie.nearest(tokens)
        prefixes = [k for k in live if tuple(tokens[: len(k)]) == k]
        want_plen = max(map(len, prefixes), default=0)
        assert plen == want_plen and (prefix is None) == (not prefixes)
        if prefix is not None:
            assert tuple(prefix.tokens) == tuple(tokens[:plen])
        best = max((common(k, tokens) for k in live), default=0)
        if best > want_plen:
            assert longer is not None and shared == best
            assert common(longer.tokens, tokens) == best
        else:
            assert longer is None


def test_shared_prefixes_group_neighbours():
    a, b = [1] * 40, [2] * 40
    assert shared_prefixes([[*a, 5], [*a, 6], [*b, 7]], 32) == [a]
    assert shared_prefixes([[*a, 5], [*b, 6]], 32) == []
    assert shared_prefixes([a, a], 32) == [a[:-1]]  # a row keeps a token to prefill
    assert shared_prefixes([[*a[:20], 5], [*a[:20], 6]], 32) == []


# -- through real workers ------------------------------------------------------------


def _info_worker(
    redis_url: str, queue: str, queries: int, key: str = "prompt_cache_queries"
) -> dict:
    """The worker's entry in ``mlxq info --json`` once its ``key`` reaches ``queries`` (the
    worker publishes its counters about once a second)."""
    deadline = time.monotonic() + 30
    while True:
        out = subprocess.run(
            [sys.executable, "-m", "mlxq.producer.cli", "info", "--json", "--redis-url", redis_url],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        ws = [w for w in json.loads(out.stdout)["workers"] if w["queue"] == queue and w["alive"]]
        if (ws and ws[0].get(key, 0) >= queries) or time.monotonic() > deadline:
            assert ws, out.stdout
            return ws[0]
        time.sleep(0.3)


def _submit_all(client: Client, seeded: bool) -> list[list[int]]:
    out = []
    for i, q in enumerate(QUESTIONS[:3]):
        kw = {"temperature": 0.9, "seed": 7 + i} if seeded else {}
        out.append(client.submit(PREFIX + q, max_tokens=8, **kw).result(timeout=120).token_ids)
    return out


@pytest.mark.e2e
def test_workers_with_and_without_the_cache_agree_and_count(redis_server, queue_name, start_worker):
    off_queue = queue_name + "-off"
    start_worker(queue=off_queue, prompt_cache_bytes=0)
    start_worker()  # the cache is on by default
    on, off = Client(redis_server.url, queue=queue_name), Client(redis_server.url, queue=off_queue)
    for seeded in (False, True):
        assert _submit_all(on, seeded) == _submit_all(off, seeded)
    w = _info_worker(redis_server.url, queue_name, 6)
    assert w["prompt_cache_queries"] == 6
    assert w["prompt_cache_hits"] == 5  # all but the first
    assert w["prompt_tokens_cached"] >= 5 * 400
    assert w["prompt_cache_bytes"] > 0
    assert w["prompt_tokens_prefilled"] < w["prompt_tokens"] / 3
    w = _info_worker(redis_server.url, off_queue, 6 * 400, "prompt_tokens")
    assert w["prompt_cache_queries"] == w["prompt_cache_hits"] == w["prompt_cache_bytes"] == 0
    assert w["prompt_tokens_prefilled"] == w["prompt_tokens"]


@pytest.mark.e2e
def test_cancel_failure_and_restart_leave_the_cache_sound(
    redis_server, queue_name, start_worker, loaded
):
    off_queue = queue_name + "-off"
    start_worker(queue=off_queue, prompt_cache_bytes=0)
    worker = start_worker(window_ms=0, prompt_cache_bytes=1 << 30)
    on, off = Client(redis_server.url, queue=queue_name), Client(redis_server.url, queue=off_queue)
    want = off.submit(PREFIX + QUESTIONS[1], max_tokens=8).result(timeout=120).token_ids
    running = on.submit(PREFIX + QUESTIONS[1], max_tokens=1000, temperature=1.0, seed=3)
    it = running.stream(timeout=120)
    next(it)
    assert running.cancel() is True
    assert list(it)[-1].finish_reason == "canceled"
    assert on.submit(PREFIX + QUESTIONS[1], max_tokens=8).result(timeout=120).token_ids == want
    no_eos = {t: -100.0 for t in loaded[1].eos_token_ids}
    slow = on.submit(PREFIX + QUESTIONS[1], max_tokens=900, logit_bias=no_eos, timeout=0.5)
    with pytest.raises(JobFailed, match="timeout"):
        slow.result(timeout=120)
    assert on.submit(PREFIX + QUESTIONS[1], max_tokens=8).result(timeout=120).token_ids == want
    worker.stop()
    start_worker(prompt_cache_bytes=1 << 30)  # a new process: its cache starts empty
    assert on.submit(PREFIX + QUESTIONS[1], max_tokens=8).result(timeout=120).token_ids == want
    w = _info_worker(redis_server.url, queue_name, 1)
    assert w["prompt_cache_queries"] == 1 and w["prompt_cache_hits"] == 0
    assert on.submit(PREFIX + QUESTIONS[1], max_tokens=8).result(timeout=120).token_ids == want
    w = _info_worker(redis_server.url, queue_name, 2)
    assert w["prompt_cache_hits"] == 1


@pytest.mark.e2e
def test_a_redis_restart_during_a_cached_job_loses_and_repeats_nothing(
    persistent_redis, queue_name, start_worker, loaded
):
    """The cache is the worker's own memory: Redis going away mid-job changes nothing in
    it, and the job that decodes from a hit streams every token once."""
    from listener import Listener

    url = persistent_redis.url
    off_queue = queue_name + "-off"
    start_worker(queue=off_queue, redis_url=url, prompt_cache_bytes=0)
    start_worker(redis_url=url, window_ms=0, prompt_cache_bytes="auto")  # sized from the device
    on, off = Client(url, queue=queue_name), Client(url, queue=off_queue)
    on.submit(PREFIX + QUESTIONS[0], max_tokens=4).result(timeout=120)
    no_eos = {t: -100.0 for t in loaded[1].eos_token_ids}  # it runs its 900 tokens
    long = on.submit(PREFIX + QUESTIONS[1], max_tokens=900, temperature=1.0, logit_bias=no_eos)
    listener = Listener(long)
    deadline = time.monotonic() + 60
    while long.status() != "started":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    persistent_redis.restart()
    assert long.result(timeout=120).finish_reason == "length"
    listener.check()
    w = _info_worker(url, queue_name, 2)
    assert w["prompt_cache_hits"] >= 1 and w["prompt_tokens_cached"] >= 400
    prompt = PREFIX + QUESTIONS[2]
    want = off.submit(prompt, max_tokens=8).result(timeout=120).token_ids
    assert on.submit(prompt, max_tokens=8).result(timeout=120).token_ids == want


@pytest.mark.e2e
def test_prometheus_counts_the_prefix_cache(redis_server, queue_name, start_worker):
    import socket
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    start_worker(metrics_port=port, metrics_host="127.0.0.1", prompt_cache_bytes=1 << 30)
    client = Client(redis_server.url, queue=queue_name)
    for q in QUESTIONS[:2]:
        client.submit(PREFIX + q, max_tokens=4).result(timeout=120)

    def scrape() -> dict[str, float]:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as res:
            text = res.read().decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    deadline = time.monotonic() + 30
    while (m := scrape()).get("mlxq_prefix_cache_queries_total", 0) < 2:
        assert time.monotonic() < deadline, m
        time.sleep(0.3)
    assert m["mlxq_prefix_cache_hits_total"] == 1
    assert m["mlxq_prefix_cache_tokens_total"] >= 400
    assert m["mlxq_prefix_cache_bytes"] > 0
    assert m["mlxq_prompt_tokens_prefilled_total"] < m["mlxq_prompt_tokens_total"]
