"""A streamed completion across a restart of its job: go on where the client is, or void.

An SSE client cannot take text back. When a job's stream says ``reset`` (its worker went
on under a new attempt after a failover, restreaming its whole text, or the job ran
again), the gateway keeps the stream only while the new text repeats what the client was
sent: that part is skipped and the rest goes out. Any difference voids the stream (the
client is told to retry), as every reset did before.
"""

from __future__ import annotations

from dataclasses import replace

from mlxq.producer.codec import Chunk


class Void(Exception):
    """The restarted text differs from what the client was sent."""


class Resume:
    """The text sent per choice, and after a reset what is still to be skipped."""

    def __init__(self) -> None:
        self.sent: dict[int, str] = {}
        self.skip: dict[int, str] = {}

    def reset(self) -> None:
        """The job's text starts over: what was sent must come again, unsent."""
        self.skip = {i: t for i, t in self.sent.items() if t}

    def admit(self, c: Chunk) -> Chunk:
        """``c`` less what the client already has.

        Raises:
            Void: the text differs from what was sent (or carries log-probs, which
                cannot be cut with the text).
        """
        want = self.skip.get(c.index, "")
        if want:
            if c.logprobs is not None:
                raise Void
            if c.text.startswith(want):
                del self.skip[c.index]
                c = replace(c, text=c.text[len(want) :])
            elif want.startswith(c.text):
                self.skip[c.index] = want[len(c.text) :]
                c = replace(c, text="")
            else:
                raise Void
        self.sent[c.index] = self.sent.get(c.index, "") + c.text
        return c
