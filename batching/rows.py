"""What each row of a continuous batch asked for, bound to the rows of each step.

mlx-lm samples a step with one call only when every row holds the same sampler object,
so every row gets one :class:`RowSampler`. It knows each row's own sampling params,
logits processors (:mod:`mlxq.batching.logits`) and log-prob request, by mlx-lm uid;
``bind(uids)`` names the rows of the next step in batch order, and the per-row arrays
for them are built once per batch composition, not once per step. Seeded rows need each
row's position (tokens it sampled so far), which each row's record counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlxq.batching.grammar import GrammarRows, RowMatcher
from mlxq.batching.logits import LogitsRows
from mlxq.batching.logprobs import LogprobRows
from mlxq.batching.sampler import RowParams, sample
from mlxq.producer.logits_params import LogitsParams
from mlxq.producer.params import SamplingParams


@dataclass(slots=True, eq=False)
class _Row:
    """What one row asked for, how many tokens it generated before it joined (a row put
    back after a pause), and how many it sampled before the current binding."""

    params: SamplingParams
    logits: LogitsParams | None
    top_logprobs: int | None
    before: int = 0
    done: int = 0
    grammar: RowMatcher | None = None


class RowSampler:
    """The one sampler of a batch; also the keeper of its rows' other requests.

    Args:
        vocab_size: The model's vocabulary size (the logits' width).
        eos_token_ids: The model's end-of-sequence ids (``min_tokens`` masks them).
    """

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.eos = tuple(eos_token_ids)
        self._by_uid: dict[int, _Row] = {}
        self._uids: list[int] = []
        self._bound: list[_Row] = []  # the rows of ``_uids``, in batch order
        self._params: RowParams | None = None
        self._logits_rows: LogitsRows | None = None
        self._logprob_rows: LogprobRows | None = None
        self._grammar_rows: GrammarRows | None = None
        self._calls_bound = 0
        self.calls = 0

    def add(
        self,
        uid: int,
        params: SamplingParams,
        logits: LogitsParams | None = None,
        top_logprobs: int | None = None,
        generated: int = 0,
        grammar: RowMatcher | None = None,
    ) -> None:
        """A row joins: its sampling params, processors, log-prob request (None: none;
        else how many alternatives it wants), the tokens it generated before (a row
        put back after a pause goes on from there: its seeded draws and ``min_tokens``)
        and its constraint's matcher (None: unconstrained), which the row's record owns."""
        if grammar is not None:
            grammar.fresh = True  # its first step is fed a token it has seen
        self._by_uid[uid] = _Row(params, logits, top_logprobs, generated, generated, grammar)

    def drop(self, uid: int) -> None:
        self._by_uid.pop(uid, None)

    def generated_before(self, uid: int) -> int:
        """Tokens a row generated before it joined (0 but for a row put back)."""
        row = self._by_uid.get(uid)
        return row.before if row is not None else 0

    def context(self, uid: int) -> int:
        """How many trailing tokens a row's processors read (0: none)."""
        row = self._by_uid.get(uid)
        return row.logits.context_size if row is not None and row.logits is not None else 0

    def bind(self, uids: Sequence[int]) -> None:
        if uids == self._uids:  # the common case, every decode step: no copy
            return
        for row in self._bound:  # fold the calls since the last binding into each row's count
            row.done += self._calls_bound
        self._uids = list(uids)
        self._bound = [self._by_uid[u] for u in self._uids]
        self._calls_bound = 0
        self._params = RowParams.from_params([r.params for r in self._bound])
        self._logits_rows = None
        tops = [r.top_logprobs for r in self._bound]
        self._logprob_rows = (
            LogprobRows.from_requests(tops) if any(t is not None for t in tops) else None
        )
        self._grammar_rows = GrammarRows.bind([r.grammar for r in self._bound], self.vocab_size)

    def logits_rows(self, vocab_size: int) -> LogitsRows | None:
        """The bound rows' processors as arrays; None when no row has any."""
        if not any(r.logits is not None for r in self._bound):
            return None
        if self._logits_rows is None or self._logits_rows.vocab_size != vocab_size:
            self._logits_rows = LogitsRows.from_params(
                [r.logits for r in self._bound], vocab_size, self.eos
            )
        return self._logits_rows

    @property
    def sampled_count(self) -> int:
        """How many bound rows draw by sampling (the rest take the argmax)."""
        return sum(not r.params.greedy for r in self._bound)

    @property
    def grammar_rows(self) -> GrammarRows | None:
        """The bound rows' constraints; None when no row has one."""
        return self._grammar_rows

    @property
    def logprob_rows(self) -> LogprobRows | None:
        """Which bound rows want log-probs; None when none does."""
        return self._logprob_rows

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self._params is None or logprobs.shape[0] != len(self._uids):
            raise RuntimeError(f"sampler bound to {len(self._uids)} rows, got {logprobs.shape[0]}")
        self.calls += 1
        # On the host: the seeded rows' keys are made there (sampler._keys), and only they
        # read a position.
        n = self._calls_bound
        positions = [r.done + n for r in self._bound] if self._params.any_seeded else ()
        tokens = sample(logprobs, self._params, positions)
        self._calls_bound += 1
        return tokens
