"""Rows that keep their place in a decoding batch's KV cache.

Why. mlx-lm's batch cache grows by concatenation and shrinks by a gather: each row that
joins or leaves copies every layer's keys and values, about a hundred launches on the host
for a 24-layer model, and the step after it runs on new arrays. Beside a sweep, each chat
job joins once and leaves once: on an H100 (0.5B shape, 64 rows, the chat rows inside
them) the joins cost the sweep 0.18 ms a decode step, the leaves 0.05 and the steps just
after a change 0.17-0.18 more, where the whole of the priority target's allowance is about
0.55 ms a step (docs/benchmarks.md).

How. A row that leaves leaves its slot (its row of every layer) dead: stale, fed a token
each step (one gather of the inputs) and its logits never read (one gather of the rows it
keeps). A row that joins writes its KV into a dead slot, ending where the batch's rows
end, with the left padding that hides what the slot held before: one write of each
layer's keys and values, nothing else copied. The batch drops its dead slots (a gather of
the live ones, as mlx-lm's filter) only when rows cannot all join in place (more rows
than dead slots, as a batch grows, or a row longer than the batch's columns); and it cuts
the columns no live row reaches once there are :data:`CUT_COLUMNS` of them, not at every
leave. A sweep's rows, started together with the same length, end together and are
refilled together: however many leave, their slots wait for the refill (a rule that
gathered past a few dead slots left the tiny model's sweep joining 10 rows by copy for
each one in place). A dead slot still costs its row's attention every step, so a batch
whose dead slots wait more than :data:`IDLE_STEPS` steps has shrunk for good and gathers
them. Caches of other kinds (rotating, state space) keep mlx-lm's ways: no slot stays
dead.

Where. On a GPU a dead slot costs next to nothing (on CUDA, rows run in tiles of 64; a
batch never holds more slots than its most rows). On a CPU every row is computed: there
the tiny model's decode step took 7% longer with dead slots kept (four runs each way,
alternating, docs/benchmarks.md), so a batch on the CPU keeps none. ``MLXQ_KV_SLOTS=1``
or ``0`` chooses either way on any device, to compare the two on one machine.

A dead slot's attention still sees at least its newest column (its left padding never
passes the batch's end), so its stale rows stay finite and never reach a live row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxq.worker.env import env_switch
from mlxq.worker.kv_pack import cut_to, filter_rows

#: Columns before every live row's first token that a leave leaves in place: fewer cost a
#: few keys of masked attention a step, a cut costs a copy of every layer in the next step.
CUT_COLUMNS = 32
#: Decode steps a dead slot waits for a row before the batch gathers its live ones: a
#: sweep's refill comes within a few steps, a first level's kept rows fill between chat
#: jobs within a second or two (about 100 steps a second on an H100); past that the
#: batch has shrunk, and every dead slot's attention runs each step for nothing.
IDLE_STEPS = 256
ENV = "MLXQ_KV_SLOTS"


def enabled() -> bool:
    """Whether rows that leave leave their slots dead: ``MLXQ_KV_SLOTS`` (1 or 0), else
    where MLX computes on a GPU."""
    return env_switch(ENV, mx.default_device().type == mx.DeviceType.gpu)


def slotted(caches: Sequence[Any]) -> bool:
    """Whether every layer is a batch KV cache holding something, whose rows can keep
    their places."""
    return bool(caches) and all(type(c) is BatchKVCache and c.keys is not None for c in caches)


class Slots:
    """Where each of a batch's rows lives in its caches, and the slots no row holds.

    ``of[i]`` is row ``i``'s slot (None: row ``i`` in slot ``i``, no slot dead). Rows are
    in the order of the batch's lists (mlx-lm's: joined rows last); slots are the caches'
    rows."""

    def __init__(self) -> None:
        self.of: list[int] | None = None
        self.free: list[int] = []
        self.keep_places = enabled()
        #: Decode steps taken, and the step each dead slot died at.
        self.steps = 0
        self._died: dict[int, int] = {}
        self._feed: mx.array | None = None
        self._rows: mx.array | None = None
        #: Why the last rows that could not join in place could not (:meth:`join`).
        self.refused = ""

    def width(self, rows: int) -> int:
        """The caches' rows for a batch of ``rows`` rows."""
        return rows + len(self.free)

    def slot(self, row: int) -> int:
        return row if self.of is None else self.of[row]

    def _placed(self, rows: int) -> list[int]:
        """Each of ``rows`` rows' slot."""
        return list(range(rows)) if self.of is None else self.of

    def _set(self, of: list[int] | None, free: list[int]) -> None:
        if of is not None and not free and of == list(range(len(of))):
            of = None
        self.of, self.free = of, free
        self._died = {s: self._died.get(s, self.steps) for s in free}
        self._feed = self._rows = None

    def tick(self) -> bool:
        """Count a decode step; True when a dead slot has waited past
        :data:`IDLE_STEPS` for a row (then :meth:`drop_dead`)."""
        self.steps += 1
        return bool(self._died) and self.steps - min(self._died.values()) > IDLE_STEPS

    def feed(self, tokens: mx.array) -> mx.array:
        """Each row's input (``tokens``, one a row) as one a slot: a dead slot is fed any
        row's (its output is never read)."""
        if self.of is None:
            return tokens
        if self._feed is None:
            where = [0] * (len(self.of) + len(self.free))
            for row, s in enumerate(self.of):
                where[s] = row
            self._feed = mx.array(where)
        return tokens[self._feed]

    def rows(self) -> mx.array | None:
        """The slots of the rows, in row order, to take a pass's outputs by (None: every
        slot is its row's)."""
        if self.of is None:
            return None
        if self._rows is None:
            self._rows = mx.array(self.of)
        return self._rows

    def select(self, out: mx.array) -> mx.array:
        """A pass's outputs over the slots (slots x ...) as the rows' (rows x ...)."""
        rows = self.rows()
        return out if rows is None else out[rows]

    def clear(self) -> None:
        self._set(None, [])

    def leave(
        self, caches: list[Any], rows: int, keep: list[int], held: list[int]
    ) -> Literal["kept", "cut", "gathered", "cleared"]:
        """Of ``rows`` rows, rows ``keep`` stay (row ``keep[i]`` holding ``held[i]``
        tokens) and the others leave their slots dead: the caches are ``kept`` as they
        are, or ``cut`` (:data:`CUT_COLUMNS`). Where caches cannot keep places (or the
        slots are off), the live slots are ``gathered`` (mlx-lm's filter); with no row
        kept, the caches are ``cleared``."""
        if not keep:
            caches.clear()
            self.clear()
            return "cleared"
        before = self._placed(rows)
        kept = set(keep)
        of = [before[i] for i in keep]
        freed = [s for i, s in enumerate(before) if i not in kept]
        if not self.keep_places or not slotted(caches):
            self._gather(caches, of, held)
            return "gathered"
        self._set(of, sorted(self.free + freed))
        if caches[0]._idx - max(held) < CUT_COLUMNS:
            return "kept"
        cut_to(caches, max(held))
        return "cut"

    def drop_dead(self, caches: list[Any], held: list[int]) -> None:
        """Gather the live slots, each row ``i`` holding ``held[i]`` tokens: no slot dead
        (before rows join by mlx-lm's concatenation)."""
        if self.free:
            assert self.of is not None
            self._gather(caches, list(self.of), held)

    def _gather(self, caches: list[Any], of: list[int], held: list[int]) -> None:
        # The live slots in their order in the caches: rows kept in one run stay a slice
        # (kv_pack._one_run), and row i goes to the place of its slot among them.
        order = sorted(range(len(of)), key=of.__getitem__)
        slots = [of[i] for i in order]
        filter_rows(caches, slots, [held[i] for i in order])
        place = {s: j for j, s in enumerate(slots)}
        self._set([place[s] for s in of], [])

    def appended(self, rows: int, n: int) -> None:
        """``n`` rows joined a batch of ``rows`` by concatenation: theirs are the caches'
        last slots."""
        if self.of is not None:
            self._set([*self.of, *range(rows, rows + n)], [])

    def _refusal(self, ours: list[Any], theirs: list[Any], their_held: list[int]) -> str:
        """Why the rows of ``theirs`` cannot join ``ours`` in place ("" where they can)."""
        n = len(their_held)
        if not self.keep_places:
            return "slots off"
        if not n or len(ours) != len(theirs) or not slotted(ours) or not slotted(theirs):
            return "other caches"
        if n > len(self.free):
            return "fewer dead slots than rows" if self.free else "no dead slot"
        end, their_end, span = ours[0]._idx, theirs[0]._idx, max(their_held)
        if min(their_held) < 1 or span > min(end, their_end):
            return "a row longer than the batch"
        for c, t in zip(ours, theirs, strict=True):
            if (
                c._idx != end
                or t._idx != their_end
                or c.keys.dtype != t.keys.dtype
                or c.keys.shape[1:2] + c.keys.shape[3:] != t.keys.shape[1:2] + t.keys.shape[3:]
                or c.values.shape[3:] != t.values.shape[3:]
            ):
                return "other caches"
        return ""

    def join(
        self, ours: list[Any], held: list[int], theirs: list[Any], their_held: list[int]
    ) -> bool:
        """Write the rows of ``theirs`` (row j holding ``their_held[j]`` tokens, which end
        at its ``_idx``) into dead slots of ``ours`` (row i holding ``held[i]``): True if
        they joined so, their rows after ours; False, nothing changed, if they cannot (too
        few dead slots, other kinds of cache, or a row longer than ours are: ``refused``
        says which)."""
        self.refused = self._refusal(ours, theirs, their_held)
        if self.refused:
            return False
        n, end, their_end = len(their_held), ours[0]._idx, theirs[0]._idx
        span = max(their_held)
        slots, free = self.free[:n], self.free[n:]
        at: Any = slice(slots[0], slots[0] + 1) if n == 1 else mx.array(slots)
        cols, their_cols = slice(end - span, end), slice(their_end - span, their_end)
        for c, t in zip(ours, theirs, strict=True):
            c.keys[at, :, cols] = t.keys[:, :, their_cols]
            c.values[at, :, cols] = t.values[:, :, their_cols]
        of = [*self._placed(len(held)), *slots]
        # Every row's padding and tokens held, known on the host; a dead slot sees its
        # newest column only. All layers share both (each layer pads its rows alike).
        width = len(of) + len(free)
        pad, count = [end - 1] * width, [1] * width
        for s, h in zip(of, [*held, *their_held], strict=True):
            pad[s], count[s] = end - h, h
        left_padding, offset = mx.array(pad), mx.array(count)
        for c in ours:
            c.left_padding, c.offset = left_padding, offset
        self._set(of, free)
        return True
