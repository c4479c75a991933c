"""Cancel requests for jobs this worker holds, heard as they are made.

A producer's cancel sets a durable flag on the job and publishes its id on the channel of
the worker holding it (``mlxq:cancel:<worker>``). This thread passes on the ids of jobs
the worker holds; anything else (ids it does not hold, bytes that are no id) costs the
decode loop nothing. A message missed while reconnecting is caught by the heartbeat's
periodic look at the flags.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from mlxq.producer import keys
from mlxq.producer.connection import TRANSIENT, Outage, backoff
from mlxq.worker.bridge import Bridge

log = logging.getLogger("mlxq.worker")


class CancelListener:
    """Listens on this worker's cancel channel.

    Args:
        bridge: The worker's Redis.
        inbox: The decode loop's inbox: ``("cancel", [job id])``.
        holds: Whether the worker holds a job id.
    """

    def __init__(
        self,
        bridge: Bridge,
        inbox: queue.SimpleQueue[tuple[str, Any]],
        holds: Callable[[str], bool],
    ) -> None:
        self.bridge, self.inbox, self.holds = bridge, inbox, holds
        self.ignored = 0
        self._stop = threading.Event()
        self._outage = Outage(log, "cancel listener")
        self._thread = threading.Thread(target=self._run, name="mlxq-cancels", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            pubsub = self.bridge.redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(keys.cancel_channel(self.bridge.name))
                self._outage.ok()
                failures = 0
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.2)
                    if msg is not None:
                        self._on(msg.get("data"))
            except TRANSIENT as e:
                self._outage.failed(e)
                failures += 1
                self._stop.wait(backoff().compute(failures))
            except Exception:  # this thread must outlive whatever one message holds
                log.exception("cancel listener: going on after an unexpected error")
                self._stop.wait(0.2)
            finally:
                with contextlib.suppress(Exception):  # a broken connection: nothing to close
                    pubsub.close()

    def _on(self, data: Any) -> None:
        try:
            job_id = data.decode("utf-8") if isinstance(data, bytes) else None
        except UnicodeDecodeError:
            job_id = None
        if job_id is None or len(job_id) > 200 or not self.holds(job_id):
            self.ignored += 1
            return
        self.inbox.put(("cancel", [job_id]))
