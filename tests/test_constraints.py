"""Structured outputs without Redis: the constraint contract, the batch's mask, the engine.

The engine runs the tiny random-weight model, whose free text is noise: every answer
below parses or matches only because the constraint held it to its shape.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from mlxq.producer.client import build_request
from mlxq.producer.constraints import (
    MAX_CONSTRAINT_CHARS,
    Constraint,
    from_response_format,
    from_structured_outputs,
)
from mlxq.producer.errors import InvalidRequest, PayloadError
from mlxq.producer.openai_api import parse_request
from mlxq.producer.params import GenerationRequest

mlx_lm = pytest.importorskip("mlx_lm")
mx = pytest.importorskip("mlx.core")

from mlxq.batching.grammar import apply_bitmask, bitmask_width  # noqa: E402
from mlxq.worker.engine import Engine  # noqa: E402
from mlxq.worker.jobs import Job, apply_deltas  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[0-9]{3}-[a-z]{2,5}"


# The contract: canonical values, the fields errors name.


def test_equal_constraints_compare_and_hash_equal():
    a = build_request("x", json_schema={"type": "object", "b": 1}).constraint
    b = build_request("x", json_schema='{"type": "object",  "b": 1}').constraint
    c = build_request(
        "x",
        response_format={
            "type": "json_schema",
            "json_schema": {"schema": {"type": "object", "b": 1}},
        },
    ).constraint
    assert a == b == c and len({a, b, c}) == 1
    # Key order is kept: it is the order an answer writes the properties in.
    assert build_request("x", json_schema={"b": 1, "type": "object"}).constraint != a
    assert build_request("x", choice=["a", "b"]).constraint == Constraint.of_choice(["a", "b"])
    assert build_request("x", response_format={"type": "text"}).constraint is None


def test_the_payload_carries_the_constraint_only_when_set():
    plain = build_request("x").to_payload()
    assert "constraint" not in plain
    req = build_request("x", regex=REGEX, max_tokens=7)
    payload = req.to_payload()
    assert payload["constraint"] == {"kind": "regex", "value": REGEX}
    assert GenerationRequest.from_payload(payload) == req


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"regex": "[a-"}, "regex="),
        ({"json_schema": {"type": "nope"}}, "json_schema="),
        ({"json_schema": "{not json"}, "json_schema="),
        ({"grammar": "start: missing_rule"}, "grammar="),
        ({"choice": []}, "choice="),
        ({"choice": ["a", 5]}, "choice[1]="),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format.json_schema.schema=",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type="),
        ({"regex": "a", "choice": ["a"]}, "regex="),
        ({"regex": "a+", "min_tokens": 3}, "min_tokens="),
        ({"constraint": {"kind": "regex", "value": "(("}}, "constraint="),
        ({"json_schema": {"description": "x" * MAX_CONSTRAINT_CHARS}}, "json_schema="),
    ],
)
def test_bad_constraints_are_refused_at_submit_naming_the_field(kw, field):
    with pytest.raises(PayloadError) as e:
        build_request("x", **kw)
    assert str(e.value).startswith(field), str(e.value)


def test_a_schema_nested_past_the_stack_is_refused_by_name():
    deep: dict[str, object] = {}
    cur = deep
    for _ in range(5000):
        cur["x"] = cur = {}
    with pytest.raises(PayloadError, match=r"^json_schema=.*nested too deeply"):
        build_request("x", json_schema=deep)


def test_a_payload_altered_to_a_bad_constraint_is_refused():
    payload = build_request("x", regex="a+").to_payload()
    payload["constraint"] = {"kind": "regex", "value": "(("}
    with pytest.raises(PayloadError, match=r"^constraint="):
        GenerationRequest.from_payload(payload)
    payload["constraint"] = {"kind": "sql", "value": "x"}
    with pytest.raises(PayloadError, match=r"constraint.kind="):
        GenerationRequest.from_payload(payload)


def test_openai_and_vllm_bodies_map_to_one_constraint():
    def body(**kw):
        return {"model": "q", "messages": [{"role": "user", "content": "hi"}], **kw}

    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    got = parse_request(body(response_format=rf), "/v1/chat/completions").submit["constraint"]
    assert got == Constraint.of_json_schema(SCHEMA)
    so = parse_request(body(structured_outputs={"choice": CHOICES}), "/v1/chat/completions")
    assert so.submit["constraint"] == Constraint.of_choice(CHOICES)
    assert from_structured_outputs({"json": json.dumps(SCHEMA)}) == got
    assert from_response_format({"type": "json_object"}) == Constraint.of_json_object()
    with pytest.raises(InvalidRequest) as e:
        parse_request(body(structured_outputs={"regex": "[a-"}), "/v1/chat/completions")
    assert e.value.param == "structured_outputs.regex"
    guided = parse_request(body(guided_choice=CHOICES), "/v1/chat/completions")
    assert guided.submit["constraint"] == Constraint.of_choice(CHOICES)
    with pytest.raises(InvalidRequest) as e:
        parse_request(body(guided_regex="[a-"), "/v1/chat/completions")
    assert e.value.param == "guided_regex"
    with pytest.raises(InvalidRequest) as e:
        parse_request(body(guided_regex="a", response_format=rf), "/v1/chat/completions")
    assert e.value.param == "guided_regex" and "not both" in str(e.value)
    off = {"choice": CHOICES, "disable_any_whitespace": False, "whitespace_pattern": None}
    assert from_structured_outputs(off) == Constraint.of_choice(CHOICES)
    with pytest.raises(PayloadError, match=r"^structured_outputs.whitespace_pattern="):
        from_structured_outputs({"choice": CHOICES, "whitespace_pattern": " "})
    with pytest.raises(InvalidRequest) as e:
        bad = {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}
        parse_request(body(response_format=bad), "/v1/chat/completions")
    assert e.value.param == "response_format.json_schema.schema"


# The mask: one op over the batch.


def _pack(allowed: list[list[bool]]) -> mx.array:
    words = []
    for row in allowed:
        w = [0] * bitmask_width(len(row))
        for j, ok in enumerate(row):
            if ok:
                w[j // 32] |= 1 << (j % 32)
        words.append([x - (1 << 32) if x >= 1 << 31 else x for x in w])
    return mx.array(words, dtype=mx.int32)


def test_the_bitmask_sets_exactly_the_disallowed_tokens_to_minus_infinity():
    vocab = 70  # three words, the last one partly past the vocabulary
    allowed = [[True] * vocab, [j in (0, 31, 32, 63, 69) for j in range(vocab)]]
    logits = mx.arange(2 * vocab, dtype=mx.float32).reshape(2, vocab)
    out = apply_bitmask(logits, _pack(allowed))
    for i in range(2):
        for j in range(vocab):
            want = float(logits[i, j]) if allowed[i][j] else -float("inf")
            assert float(out[i, j]) == want
    assert out.dtype == logits.dtype
    half = apply_bitmask(logits.astype(mx.bfloat16), _pack(allowed))
    assert half.dtype == mx.bfloat16 and mx.argmax(half[1]).item() == 69


def test_a_bitmask_of_some_rows_masks_those_rows_and_leaves_the_rest_as_they_were():
    vocab = 40
    logits = mx.arange(4 * vocab, dtype=mx.float32).reshape(4, vocab)
    lines = [[j < 3 for j in range(vocab)], [j == 39 for j in range(vocab)]]
    # Rows 3 and 1 constrained (lines 0 and 1), rows 0 and 2 not (line 2: none).
    out = apply_bitmask(logits, _pack(lines), mx.array([2, 1, 2, 0], dtype=mx.uint32))
    for i, line in ((3, lines[0]), (1, lines[1])):
        for j in range(vocab):
            assert float(out[i, j]) == (float(logits[i, j]) if line[j] else -float("inf"))
    assert mx.array_equal(out[0], logits[0]) and mx.array_equal(out[2], logits[2])


# The engine on the tiny model.


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return mlx_lm.load(str(tiny_model))


def _run(engine: Engine, reqs: dict[str, GenerationRequest], pause=None, cancel=None):
    jobs = {n: Job(n, r, engine.encode(r)) for n, r in reqs.items()}
    for j in jobs.values():
        j.start("exec")
    engine.add(list(jobs.values()))
    steps = 0
    while engine.active or (pause and steps < pause[2]):
        apply_deltas(engine.step())
        steps += 1
        if pause and steps == pause[1]:
            engine.pause([jobs[pause[0]]])
        if pause and steps == pause[2]:
            engine.resume([jobs[pause[0]]])
        if cancel and steps == cancel[1]:
            engine.remove([jobs[cancel[0]]])
    return {
        n: [("".join(c.text), c.token_ids, c.finish_reason) for c in j.choices]
        for n, j in jobs.items()
    }


def _mixed() -> dict[str, GenerationRequest]:
    return {
        "schema": build_request("A person:", json_schema=SCHEMA, max_tokens=120),
        "schema_hot": build_request(
            "Another:", json_schema=SCHEMA, max_tokens=120, temperature=1.2, seed=5, n=2
        ),
        "choice": build_request("Pick one", choice=CHOICES, max_tokens=10, temperature=1.0),
        "regex": build_request("Code:", regex=REGEX, max_tokens=20, top_k=5, temperature=0.8),
        "free": build_request("The harbour at dawn", max_tokens=30),
        "free_hot": build_request("Numbers", max_tokens=30, temperature=1.0, seed=9),
        "logprobs": build_request(
            "Pick", choice=CHOICES, max_tokens=10, logprobs=True, top_logprobs=3
        ),
        "penalized": build_request(
            "Code:",
            regex=REGEX,
            max_tokens=20,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            logit_bias={20: 5.0},
            stop=["-q"],
        ),
    }


def test_constrained_answers_hold_their_shape_in_a_mixed_batch(loaded):
    engine = Engine(*loaded, max_batch=16)
    got = _run(engine, _mixed())
    for text, _, finish in got["schema"] + got["schema_hot"]:
        jsonschema.validate(json.loads(text), SCHEMA)
        assert finish == "stop"
    assert all(t in CHOICES and f == "stop" for t, _, f in got["choice"] + got["logprobs"])
    for t, _, f in got["regex"] + got["penalized"]:
        # The stop string may cut an answer at "-q" (the text before it is kept).
        assert f == "stop" and (re.fullmatch(REGEX, t) or re.fullmatch("[0-9]{3}", t))
    assert re.fullmatch(REGEX, got["regex"][0][0])
    c = engine.counters
    assert c.vectorized_steps == c.decode_steps > 0
    assert c.constrained_rows == 7
    assert c.constraint_compiles == 3  # one schema, one choice, one regex
    assert c.mask_ms > 0
    # Unconstrained rows decode as they would alone.
    for name in ("free", "free_hot"):
        alone = _run(Engine(*loaded, max_batch=16), {name: _mixed()[name]})
        assert got[name] == alone[name]


def test_an_answer_writes_the_properties_in_the_schema_order(loaded):
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "boolean"}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    got = _run(Engine(*loaded, max_batch=4), {"s": build_request("Z:", json_schema=schema)})
    text = got["s"][0][0]
    assert list(json.loads(text, object_pairs_hook=lambda kv: dict(kv))) == ["zeta", "alpha"]


def test_constrained_rows_through_the_prompt_cache_decode_the_same(loaded):
    keep = ("schema", "schema_hot", "logprobs", "penalized", "free")
    long = "A long shared preamble of instructions for every row. " * 8
    reqs = {
        k: dataclasses.replace(v, prompt=long + (v.prompt or ""))
        for k, v in _mixed().items()
        if k in keep
    }
    engine = Engine(*loaded, max_batch=16, prompt_cache_bytes=64 << 20)
    first = _run(engine, reqs)
    again = _run(engine, reqs)
    assert engine.counters.prompt_cache_hits > 0
    assert again == first


def test_a_constrained_row_decodes_as_it_would_alone(loaded):
    req = build_request("Code:", regex=REGEX, max_tokens=20, temperature=0.9, seed=11)
    alone = _run(Engine(*loaded), {"r": req})
    mixed = _run(Engine(*loaded, max_batch=16), {**_mixed(), "r": req})
    assert mixed["r"] == alone["r"]


@pytest.mark.parametrize("fed", [True, False], ids=["fed-by-prefill", "own-pass"])
def test_rows_that_ride_decode_as_rows_with_a_first_pass_of_their_own(loaded, fed):
    """A lower level's rows take their first token in the batch's next decode step
    (``Engine.add(..., ride=True)``) instead of one of their own: every kind of row
    (constrained, seeded, greedy, log-probs, penalties, a stop string, n=2) joining a busy
    batch makes the same tokens, text, log-probs and ends either way, and no first-token
    pass is run for them. A row that does not ride takes its first token from the prefill
    that fed its last prompt token (``fed``), or from mlx-lm's pass of the new rows alone."""

    def run(ride: bool) -> tuple[dict, tuple[int, int]]:
        engine = Engine(*loaded, max_batch=16, fed_prefill=fed)
        reqs = {"busy": build_request("Busy", max_tokens=40, temperature=0.9, seed=1)}
        reqs.update(_mixed())
        jobs = {n: Job(n, r, engine.encode(r)) for n, r in reqs.items()}
        for j in jobs.values():
            j.start("exec")
        engine.add([jobs.pop("busy")])
        for _ in range(3):
            apply_deltas(engine.step())
        c = engine.counters
        before = (c.first_token_passes, c.first_tokens_from_prefill)
        engine.add(list(jobs.values()), ride=ride)
        while engine.active:
            apply_deltas(engine.step())
        out = {
            n: [("".join(c.text), c.token_ids, c.finish_reason, c.logprobs) for c in j.choices]
            for n, j in jobs.items()
        }
        after = (c.first_token_passes, c.first_tokens_from_prefill)
        return out, (after[0] - before[0], after[1] - before[1])

    own, (own_passes, own_fed) = run(False)
    rode, rode_counts = run(True)
    # Unseeded sampled rows draw from MLX's global generator, in another order here.
    for name in ("choice", "regex"):
        assert rode.pop(name)[0][2] == own.pop(name)[0][2] == "stop"
    assert rode == own
    rows = sum(r.n for r in _mixed().values())
    assert (own_passes, own_fed) == ((0, rows) if fed else (1, 0))
    assert rode_counts == (0, 0)


def test_log_probs_are_those_of_the_masked_distribution(loaded):
    req = build_request("Pick", choice=["yes", "no"], max_tokens=10, logprobs=True, top_logprobs=20)
    job = Job("j", req, (engine := Engine(*loaded)).encode(req))
    job.start("exec")
    engine.add([job])
    while engine.active:
        apply_deltas(engine.step())
    entries = job.choices[0].logprobs
    assert entries and "".join(job.choices[0].text) in ("yes", "no")
    first = entries[0]
    # The first token may only begin "yes" or "no" (a handful of tokens, all among the
    # top 20); every other token is masked out (its log-prob -inf, reported as OpenAI's
    # -9999), so the finite alternatives are those, and their mass is one.
    finite = [t for t in first["top_logprobs"] if t["logprob"] > -9999]
    assert finite and all(
        "yes".startswith(t["token"]) or "no".startswith(t["token"]) for t in finite
    )
    assert len(finite) < len(first["top_logprobs"])
    assert abs(sum(2.718281828459045 ** t["logprob"] for t in finite) - 1) < 1e-3


def test_a_paused_constrained_row_goes_on_as_if_never_paused(loaded):
    reqs = {
        "c": build_request("Spell", regex=r"[a-z ]{40}", max_tokens=60, temperature=1.0, seed=3),
        "g": build_request("Spell", regex=r"[a-z ]{40}", max_tokens=60),
        "by": build_request("Something else", max_tokens=50),
    }
    unpaused = _run(Engine(*loaded, max_batch=8), reqs)
    for name in ("c", "g"):
        paused = _run(Engine(*loaded, max_batch=8), reqs, pause=(name, 6, 12))
        assert paused == unpaused
        assert re.fullmatch(r"[a-z ]{40}", paused[name][0][0])


def test_a_constraint_the_model_cannot_compile_fails_at_encode(loaded):
    engine = Engine(*loaded)
    # Compiles without a tokenizer, but names a token past this model's vocabulary.
    bad = build_request("x", grammar="start: <[5000]>")
    with pytest.raises(PayloadError, match=r"constraint \(grammar\): does not compile for this"):
        engine.encode(bad)


def test_a_sweep_of_one_constraint_compiles_it_once(loaded):
    engine = Engine(*loaded)
    for i in range(5):
        engine.encode(build_request(f"q{i}", json_schema=SCHEMA))
        engine.encode(build_request(f"q{i}", choice=CHOICES))
    assert engine.counters.constraint_compiles == 2


def test_a_seeded_draw_never_picks_a_masked_token():
    # Seed 122 at position 36 once hashed to the one noise value that rounded to +inf in
    # float32, which won the draw over every allowed token.
    from mlxq.batching.sampler import RowParams, sample
    from mlxq.producer.params import SamplingParams

    allowed = [50, 60, 70, 80, 90]
    x = mx.full((1, 1024), -mx.inf)
    x[0, mx.array(allowed)] = -1.6
    rows = RowParams.from_params([SamplingParams(temperature=1.0, seed=122)])
    drawn = {sample(x, rows, mx.array([p], dtype=mx.uint32)).item() for p in range(2000)}
    assert drawn <= set(allowed)


def test_canceling_a_constrained_row_leaves_the_others_whole(loaded):
    engine = Engine(*loaded, max_batch=16)
    reqs = _mixed()
    got = _run(engine, reqs, cancel=("schema_hot", 4))
    alone = _run(
        Engine(*loaded, max_batch=16), {k: v for k, v in reqs.items() if k != "schema_hot"}
    )
    for name in ("schema", "free", "free_hot", "logprobs"):
        assert got[name] == alone[name]
    jsonschema.validate(json.loads(got["schema"][0][0]), SCHEMA)
    assert engine.counters.vectorized_steps == engine.counters.decode_steps


def test_grammar_rows_advance_each_constrained_row_and_leave_the_others_open(loaded):
    from mlxq.batching.grammar import GrammarRows
    from mlxq.worker.grammars import Grammars
    from mlxq.worker.step_counters import StepCounters

    tok = loaded[1]
    grammars = Grammars(tok, 1024, frozenset(tok.eos_token_ids), StepCounters())
    c = Constraint.of_choice(["ab", "cd"])
    rows = [grammars.row(c), None, grammars.row(c)]
    grammar = GrammarRows.bind(rows, 1024)
    assert grammar is not None and GrammarRows.bind([None, None], 1024) is None

    def ids(fed: list[int]) -> list[set[int]]:
        masked = apply_bitmask(mx.zeros((3, 1024)), grammar.masks(fed), grammar.lines)
        ok = mx.isfinite(masked).tolist()
        return [{j for j in range(1024) if ok[i][j]} for i in range(3)]

    def allowed(fed: list[int]) -> list[set[str]]:
        return [{tok.decode([j]) for j in row} for row in ids(fed)]

    (a,), (c_,) = (tok.encode(x, add_special_tokens=False) for x in ("a", "c"))
    # A row's first step: its fed token is the prompt's last, not consumed.
    first_ids = ids([a, a, a])
    assert len(first_ids[1]) == 1024  # the unconstrained row: nothing masked
    first = [{tok.decode([j]) for j in row} for row in first_ids]
    assert first[0] == first[2] and all("ab".startswith(t) or "cd".startswith(t) for t in first[0])
    after = allowed([a, 0, c_])
    assert after[0] == {"b"} and after[2] == {"d"}
    (b,), (d,) = (tok.encode(x, add_special_tokens=False) for x in ("b", "d"))
    done = allowed([b, 0, d])
    eos = {tok.decode([t]) for t in tok.eos_token_ids}
    assert done[0] == done[2] == eos


def test_lark_and_gbnf_grammars_hold_the_answer(loaded):
    reqs = {
        "lark": build_request("G:", grammar='start: "x" ("y" | "z")~2..4 "!"', max_tokens=12),
        "gbnf": build_request("G:", grammar='root ::= ("yes" | "no") " " [0-9]', max_tokens=12),
    }
    got = _run(Engine(*loaded), reqs)
    assert re.fullmatch("x[yz]{2,4}!", got["lark"][0][0]) and got["lark"][0][2] == "stop"
    assert re.fullmatch("(yes|no) [0-9]", got["gbnf"][0][0]) and got["gbnf"][0][2] == "stop"


REAL_EOS = {"qwen3": [151645, 151643], "llama3_1": [128001, 128008, 128009], "gemma3": [1, 106]}


@pytest.fixture(scope="module", params=sorted(REAL_EOS))
def real_loaded(request, tmp_path_factory):
    import os
    from pathlib import Path

    from mlxq.worker.tiny import build_tiny_model_with_tokenizer

    cache = Path(os.environ.get("MLXQ_TOKENIZER_CACHE", Path.home() / ".cache/mlxq/tokenizers"))
    src = cache / request.param
    if not (src / "tokenizer.json").is_file():
        pytest.skip(f"no {request.param} tokenizer in {cache}: `make tokenizers` fetches it")
    path = build_tiny_model_with_tokenizer(
        tmp_path_factory.mktemp(request.param), src, eos_ids=REAL_EOS[request.param]
    )
    return mlx_lm.load(str(path))


def test_real_tokenizers_hold_the_answer(real_loaded):
    words = ["café", "naïve", "你好", "🙂 ok"]
    reqs = {
        "schema": build_request(
            "A person:", json_schema=SCHEMA, max_tokens=120, seed=1, temperature=1.0
        ),
        "choice": build_request("Pick:", choice=words, max_tokens=12, temperature=1.0, n=4),
        "regex": build_request("Code:", regex=REGEX, max_tokens=20, temperature=1.0, seed=2),
    }
    got = _run(Engine(*real_loaded, max_batch=8), reqs)
    jsonschema.validate(json.loads(got["schema"][0][0]), SCHEMA)
    assert all(t in words and f == "stop" for t, _, f in got["choice"])
    assert re.fullmatch(REGEX, got["regex"][0][0])
