"""The tokens mlx-lm's BatchGenerator hands its processors are what TokenHistory keeps.

Runs mlx-lm 0.32.2's own ``BatchGenerator`` on the tiny model with processors that
record what they are given, alongside real penalties, with rows of different
lengths finishing at different steps. At every step a row's processors must see
its whole prompt plus every token it generated before this one, and the
vectorized ``apply`` on the logits they got must give what mlx-lm's penalties
made of them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from mlxq.batching.history import TokenHistory
from mlxq.batching.logits import LogitsRows, apply
from mlxq.producer.logits_params import LogitsParams

mlx_lm = pytest.importorskip("mlx_lm")
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.sample_utils import make_logits_processors  # noqa: E402

PARAMS = [
    LogitsParams(repetition_penalty=1.5, repetition_context_size=6, logit_bias={5: 3.0}),
    LogitsParams(presence_penalty=1.0, frequency_penalty=0.5, frequency_context_size=9),
    LogitsParams(repetition_penalty=0.7, presence_penalty=-0.5, presence_context_size=4),
]


class Recorder:
    """Two processors around mlx-lm's own: one notes the input, one the output."""

    def __init__(self, p: LogitsParams) -> None:
        self.contexts: list[list[int]] = []
        self.seen: list[tuple[mx.array, mx.array]] = []
        self._in: mx.array | None = None
        inner = make_logits_processors(
            logit_bias=dict(p.logit_bias) if p.logit_bias else None,
            repetition_penalty=p.repetition_penalty,
            repetition_context_size=p.repetition_context_size,
            presence_penalty=p.presence_penalty,
            presence_context_size=p.presence_context_size,
            frequency_penalty=p.frequency_penalty,
            frequency_context_size=p.frequency_context_size,
        )
        self.procs = [self._before, *inner, self._after]

    def _before(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.contexts.append(tokens.tolist())  # type: ignore[arg-type]
        self._in = mx.array(logits)  # mlx-lm's penalties assign into their input
        return logits

    def _after(self, tokens: mx.array, logits: mx.array) -> mx.array:
        assert self._in is not None
        self.seen.append((self._in, mx.array(logits)))
        return logits


@pytest.fixture(scope="module")
def model(tiny_model: Any) -> Any:
    return mlx_lm.load(str(tiny_model))[0]


def test_processors_see_prompt_plus_output_and_apply_agrees(model: Any) -> None:
    prompts = [[3, 4, 5, 3, 9], [7], list(range(10, 40))]
    recorders = [Recorder(p) for p in PARAMS]
    gen = BatchGenerator(model, max_tokens=30, stop_tokens=[])
    uids = gen.insert(
        prompts, max_tokens=[12, 20, 7], logits_processors=[r.procs for r in recorders]
    )
    out: dict[int, list[int]] = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
    gen.close()
    vocab = model.args.vocab_size
    for prompt, rec, params, uid in zip(prompts, recorders, PARAMS, uids, strict=True):
        generated = out[uid]
        # mlx-lm's pipelining runs one step past a row's last token: its context is complete too.
        assert len(rec.contexts) == len(generated) + 1
        assert rec.contexts == [prompt + generated[:n] for n in range(len(generated) + 1)]
        rows = LogitsRows.from_params([params], vocab)
        history = TokenHistory.from_prompts([prompt], [params.context_size], vocab_size=vocab)
        for (before, after), token in zip(rec.seen, [*generated, None], strict=True):
            assert mx.array_equal(apply(before, history, rows), after).item()
            if token is not None:
                history = history.append(mx.array([token]))
