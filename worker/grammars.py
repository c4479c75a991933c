"""A worker's compiled constraints: one llguidance matcher per (model, constraint), cached.

A sweep of 100,000 jobs with one schema compiles it once: the first job's compiles
the constraint against the model's tokenizer (an ``LLTokenizer`` built from the
tokenizer's own ``tokenizer.json``, once, on the first constrained job), and every row
after starts from a copy of that matcher (a copy costs about a microsecond). Compiling
runs where the worker tokenizes jobs, ahead of need and off the decode thread; a
constraint that does not compile for this model fails only its job.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from typing import Any

from llguidance import LLMatcher, LLTokenizer

from mlxq.batching.grammar import RowMatcher
from mlxq.producer.constraints import Constraint
from mlxq.producer.errors import PayloadError
from mlxq.worker.step_counters import StepCounters

log = logging.getLogger("mlxq.worker")

#: Compiled constraints kept (least recently used dropped first).
MAX_COMPILED = 64


class Grammars:
    """The compiled constraints of one model.

    Args:
        tokenizer: The model's mlx-lm ``TokenizerWrapper`` (or a Hugging Face fast
            tokenizer): its ``tokenizers`` JSON is what llguidance reads.
        vocab_size: The model's logits width (the masks' width).
        eos_token_ids: The ids that end a row: a finished constraint allows only these.
        counters: Where compiles are counted.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], counters: StepCounters
    ) -> None:
        self._source, self.vocab_size = tokenizer, vocab_size
        self._eos = sorted(eos_token_ids)
        self.counters = counters
        self._tokenizer: LLTokenizer | None = None
        self._compiled: OrderedDict[Constraint, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # jobs are compiled on the prefetch thread

    def _llg_tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            try:
                self._tokenizer = LLTokenizer(
                    _tokenizer_json(self._source), n_vocab=self.vocab_size, eos_token=self._eos
                )
            except (ValueError, RuntimeError) as e:  # each constrained job fails, saying why
                why = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
                raise PayloadError(
                    f"constraint: llguidance cannot read this tokenizer: {why}"
                ) from None
        return self._tokenizer

    def compile(self, constraint: Constraint) -> LLMatcher:
        """The constraint's matcher at its start, compiled once for this model.

        Raises:
            PayloadError: it does not compile for this model's tokenizer.
        """
        with self._lock:
            matcher = self._compiled.get(constraint)
            if matcher is not None:
                self._compiled.move_to_end(constraint)
                return matcher
            tokenizer = self._llg_tokenizer()
        # Compiled outside the lock: the decode thread's copies of other constraints'
        # matchers need not wait for a large grammar.
        try:
            grammar = constraint.llguidance_grammar()
        except ValueError as e:
            raise PayloadError(f"constraint ({constraint.kind}): {e}") from None
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            why = matcher.get_error().strip().splitlines()[0][:300]
            raise PayloadError(
                f"constraint ({constraint.kind}): does not compile for this model: {why}"
            )
        with self._lock:
            if constraint not in self._compiled:
                self.counters.constraint_compiles += 1
                self._compiled[constraint] = matcher
                if len(self._compiled) > MAX_COMPILED:
                    self._compiled.popitem(last=False)
            return self._compiled.get(constraint, matcher)

    def row(self, constraint: Constraint) -> RowMatcher:
        """A new row's matcher for ``constraint``: a copy of the compiled one."""
        return RowMatcher(self.compile(constraint).deep_copy())


def _tokenizer_json(tokenizer: Any) -> str:
    """The ``tokenizers`` JSON of an mlx-lm tokenizer wrapper or a fast HF tokenizer,
    padding and truncation off (llguidance reads every token from it)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise PayloadError("constraint: this model's tokenizer is not a fast tokenizer")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return str(backend.to_str())
