"""What each row of a continuous batch asked for, bound to the rows of each step.

mlx-lm samples a step with one call only when every row holds the same sampler object,
so every row gets one :class:`RowSampler`. It knows each row's own sampling params,
logits processors (:mod:`mlxq.batching.logits`) and log-prob request, by mlx-lm uid;
``bind(uids)`` names the rows of the next step in batch order, and the per-row arrays
for them are built once per batch composition, not once per step. Seeded rows need each
row's position (tokens it sampled so far), which this counts per uid.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import mlx.core as mx

from mlxq.batching.logits import LogitsRows
from mlxq.batching.logprobs import LogprobRows
from mlxq.batching.sampler import RowParams, sample
from mlxq.producer.logits_params import LogitsParams
from mlxq.producer.params import SamplingParams


class RowSampler:
    """The one sampler of a batch; also the keeper of its rows' other requests.

    Args:
        vocab_size: The model's vocabulary size (the logits' width).
        eos_token_ids: The model's end-of-sequence ids (``min_tokens`` masks them).
    """

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.eos = tuple(eos_token_ids)
        self._params: dict[int, SamplingParams] = {}
        self._logits: dict[int, LogitsParams | None] = {}
        self._top: dict[int, int | None] = {}
        self._done: dict[int, int] = {}  # tokens sampled per uid before the current binding
        self._uids: list[int] = []
        self._rows: RowParams | None = None
        self._logits_rows: LogitsRows | None = None
        self._logprob_rows: LogprobRows | None = None
        self._positions: mx.array | None = None
        self._calls_bound = 0
        self.calls = 0

    def add(
        self,
        uid: int,
        params: SamplingParams,
        logits: LogitsParams | None = None,
        top_logprobs: int | None = None,
    ) -> None:
        """A row joins: its sampling params, processors, and log-prob request (None: none;
        else how many alternatives it wants)."""
        self._params[uid] = params
        self._logits[uid] = logits
        self._top[uid] = top_logprobs
        self._done[uid] = 0

    def drop(self, uid: int) -> None:
        for d in (self._params, self._logits, self._top, self._done):
            d.pop(uid, None)  # type: ignore[attr-defined]

    def context(self, uid: int) -> int:
        """How many trailing tokens a row's processors read (0: none)."""
        lp = self._logits.get(uid)
        return lp.context_size if lp is not None else 0

    def bind(self, uids: Sequence[int]) -> None:
        if uids == self._uids:  # the common case, every decode step: no copy
            return
        for u in self._uids:  # fold the calls since the last binding into each row's count
            if u in self._done:
                self._done[u] += self._calls_bound
        self._uids = list(uids)
        self._calls_bound = 0
        self._rows = RowParams.from_params([self._params[u] for u in self._uids])
        self._positions = mx.array([self._done[u] for u in self._uids], dtype=mx.uint32)
        self._logits_rows = None
        tops = [self._top[u] for u in self._uids]
        self._logprob_rows = (
            LogprobRows.from_requests(tops) if any(t is not None for t in tops) else None
        )

    def logits_rows(self, vocab_size: int) -> LogitsRows | None:
        """The bound rows' processors as arrays; None when no row has any."""
        if not any(self._logits.get(u) is not None for u in self._uids):
            return None
        if self._logits_rows is None or self._logits_rows.vocab_size != vocab_size:
            self._logits_rows = LogitsRows.from_params(
                [self._logits[u] for u in self._uids], vocab_size, self.eos
            )
        return self._logits_rows

    @property
    def logprob_rows(self) -> LogprobRows | None:
        """Which bound rows want log-probs; None when none does."""
        return self._logprob_rows

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self._rows is None or self._positions is None or logprobs.shape[0] != len(self._uids):
            raise RuntimeError(f"sampler bound to {len(self._uids)} rows, got {logprobs.shape[0]}")
        self.calls += 1
        tokens = sample(logprobs, self._rows, self._positions + self._calls_bound)
        self._calls_bound += 1
        return tokens
