"""A stream listener for fault tests: follows one job in a thread, as a UI would."""

from __future__ import annotations

import threading

from mlxq.producer.client import Job


class Listener:
    """Follows a job's stream in a thread: clears its text on reset; ``check()`` asserts
    no chunk came twice or out of order and the text equals the result's."""

    def __init__(self, job: Job) -> None:
        self.job, self.text, self.seqs, self.resets = job, "", [], 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for c in self.job.stream(timeout=120):
                self.seqs.append(c.seq)
                if c.kind == "reset":
                    self.text, self.resets = "", self.resets + 1
                self.text += c.text
        except BaseException as e:  # reported by check(), on the test thread
            self.error = e

    def check(self) -> None:
        self.thread.join(120)
        assert self.error is None, self.error
        assert len(self.seqs) == len(set(self.seqs)) and self.seqs == sorted(self.seqs)
        assert self.text == self.job.result(timeout=10).text
