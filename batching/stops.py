"""Stop strings over streamed text: cut at the first match, never stream part of one."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feeds a job's text as it is decoded and finds its stop strings.

    Text that could still grow into a stop string is held back, so a listener
    never sees a stop string's first half that a later token would complete.

    Args:
        stops: The job's stop strings (may be empty).
    """

    __slots__ = ("_held", "_stops")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add decoded text.

        Returns:
            (text safe to emit now, whether a stop string was found). After a
            match the emitted text ends just before the stop string.
        """
        if not self._stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = self._partial_len(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail, when the job ends for another reason."""
        out, self._held = self._held, ""
        return out

    def _partial_len(self, buf: str) -> int:
        # The longest tail of buf that is a proper prefix of some stop string.
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
