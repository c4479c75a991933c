"""Cancel requests for jobs this worker holds, heard as they are made.

A producer's cancel sets a durable flag on the job and publishes its id on the channel of
the worker holding it (``mlxq:cancel:<worker>``). This thread passes on the ids of jobs
the worker holds; anything else (ids it does not hold, bytes that are no id) costs the
decode loop nothing. A message missed while reconnecting is caught by the heartbeat's
periodic look at the flags.
"""

from __future__ import annotations

import contextlib
from typing import Any

from mlxq.producer import keys
from mlxq.worker.bridge import Bridge
from mlxq.worker.held import Held
from mlxq.worker.messages import CancelRequested, Inbox
from mlxq.worker.prefetch import readable_id
from mlxq.worker.threads import Helper


class CancelListener(Helper):
    """Listens on this worker's cancel channel.

    Args:
        bridge: The worker's Redis.
        inbox: The decode loop's inbox, for :class:`~mlxq.worker.messages.CancelRequested`.
        held: The jobs the worker holds.
    """

    def __init__(self, bridge: Bridge, inbox: Inbox, held: Held) -> None:
        super().__init__("mlxq-cancels", "cancel listener", join_s=2)
        self.bridge, self.inbox, self.held = bridge, inbox, held
        self.ignored = 0

    def _turn(self) -> None:
        """One subscription, listened to until stopped (or the connection breaks)."""
        pubsub = self.bridge.redis.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(keys.cancel_channel(self.bridge.name))
            self._ok()
            while not self._stop.is_set():
                msg = pubsub.get_message(timeout=0.2)
                if msg is not None:
                    self._on(msg.get("data"))
        finally:
            with contextlib.suppress(Exception):  # a broken connection: nothing to close
                pubsub.close()

    def _on(self, data: Any) -> None:
        job_id = readable_id(data) if isinstance(data, bytes) else None
        if job_id is None or not self.held.holds(job_id):
            self.ignored += 1
            return
        self.inbox.put(CancelRequested((job_id,)))
