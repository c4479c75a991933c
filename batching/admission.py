"""Which pending jobs enter the running batch, and how long an idle worker waits for company.

Pure decisions: plain data in, decisions out; no Redis, no MLX, no clock (the
caller passes ``step`` and ``now``), so every rule here is tested on its own.

Admission order (:func:`admit`), for the free slots of one decode step:

1. Aged jobs, oldest first. A job is *aged* once it has waited
   ``max_wait_steps`` decode steps. Ageing is what keeps a job with rare
   sampling params from being passed over forever by a stream of common ones.
2. Jobs whose param key the batch already runs. A batch with one key samples
   with one plain sampler instead of a per-row one.
3. The other keys, largest group first, so a few slots hold as few distinct
   keys as possible. Oldest first inside a key; ties go to the key whose oldest
   job is older.

Params only reorder: a slot is never left empty while a job is pending.

Wait bound. Let W = ``max_wait_steps`` and count only steps with at least one
free slot (a full batch admits nobody, whatever their params). A job that
arrived at step ``a`` is aged from step ``a + W`` on. Let A be the number of
jobs still pending at that step that are ahead of it in FIFO order (earlier
``arrived_step``, or the same step and earlier in the buffer). Later arrivals
carry a later ``arrived_step``, so they queue behind it and A can only shrink.
At any step where the job is aged but not admitted, aged jobs go first and
oldest first, so every free slot went to one of those A jobs. Hence the free
slots of all such steps sum to at most A, and with at least ``m`` free slots a
step the job enters by step ``a + W + A // m``: its wait is at most
``W + A // m`` steps, ``W + A`` in the worst case of one slot a step, and A is
below the pending buffer's capacity. ``max_wait_steps=0`` is strict FIFO.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mlxq.producer.params import ParamKey


def _check_int(name: str, value: object, lowest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{name}={value!r}: must be an integer >= {lowest}")


@dataclass(frozen=True, slots=True)
class Pending:
    """A job waiting in the worker's local buffer for a slot in the batch.

    Args:
        job_id: The job's id.
        key: Its sampling-param key, ``SamplingParams.key()``.
        arrived_step: The worker's decode-step counter when the job entered the
            buffer; it dates the job for ageing and FIFO order.
    """

    job_id: str
    key: ParamKey
    arrived_step: int


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """How :func:`admit` trades batch homogeneity against waiting.

    Args:
        max_batch: Most rows a running batch holds.
        max_wait_steps: Decode steps after which a pending job jumps ahead of
            every younger job, whatever its params. Bounds the wait (see the
            module docstring); 0 makes admission strict FIFO. The default of 32
            is about a second of decoding on a small model: long enough for a
            rare key to find a batch of its own kind, short enough to be unnoticed
            next to the generation itself.

    Raises:
        ValueError: naming the field and the bad value.
    """

    max_batch: int
    max_wait_steps: int = 32

    def __post_init__(self) -> None:
        _check_int("max_batch", self.max_batch, 1)
        _check_int("max_wait_steps", self.max_wait_steps, 0)


def _check_call(
    pending: Sequence[Pending],
    running: Mapping[ParamKey, int],
    free_slots: int,
    step: int,
    policy: AdmissionPolicy,
) -> None:
    _check_int("free_slots", free_slots, 0)
    if free_slots > policy.max_batch:
        raise ValueError(f"free_slots={free_slots!r}: more than max_batch={policy.max_batch}")
    _check_int("step", step, 0)
    for key, count in running.items():
        _check_int(f"running[{key!r}]", count, 0)
    # A job dated in the future would never age: its wait bound would be void.
    late = next((p for p in pending if p.arrived_step > step), None)
    if late is not None:
        raise ValueError(
            f"arrived_step={late.arrived_step!r}: job {late.job_id} is after step={step}"
        )


def _fill_by_homogeneity(
    fresh: Sequence[Pending], counts: Counter[ParamKey], slots: int
) -> list[Pending]:
    """Up to ``slots`` jobs of ``fresh`` (in FIFO order), running keys first,
    then larger key groups, oldest first inside a key."""
    groups: dict[ParamKey, list[Pending]] = {}
    for p in fresh:
        groups.setdefault(p.key, []).append(p)
    # The sort is stable and ``groups`` is in order of each key's oldest job,
    # so equal ranks go to the key that has waited longest.
    order = sorted(groups, key=lambda k: (counts[k] == 0, -(counts[k] + len(groups[k]))))
    chosen: list[Pending] = []
    for key in order:
        chosen.extend(groups[key][: slots - len(chosen)])
        if len(chosen) == slots:
            break
    return chosen


def admit(
    pending: Sequence[Pending],
    running: Mapping[ParamKey, int],
    free_slots: int,
    step: int,
    policy: AdmissionPolicy,
) -> list[Pending]:
    """Choose the pending jobs that enter the batch at this decode step.

    Aged jobs first, oldest first; then jobs with a key the batch runs; then the
    largest key groups; FIFO inside a key (rules and wait bound in the module
    docstring). Deterministic: the same arguments give the same list.

    Args:
        pending: The local buffer, in arrival order (ties in ``arrived_step``
            keep this order). Not modified.
        running: Rows per param key in the running batch; keys with 0 rows
            count as not running.
        free_slots: Empty rows in the batch, in ``[0, policy.max_batch]``.
        step: The current decode-step counter.
        policy: Batch size and ageing bound.

    Returns:
        ``min(free_slots, len(pending))`` distinct jobs of ``pending``, in the
        order they should take the slots.

    Raises:
        ValueError: ``free_slots`` outside ``[0, max_batch]``, a negative
            ``step`` or running count, or a job that arrived after ``step``.
    """
    _check_call(pending, running, free_slots, step, policy)
    slots = min(free_slots, len(pending))
    if slots == 0:
        return []
    fifo = sorted(pending, key=lambda p: p.arrived_step)

    def aged(p: Pending) -> bool:
        return step - p.arrived_step >= policy.max_wait_steps

    chosen = [p for p in fifo if aged(p)][:slots]
    if len(chosen) == slots:
        return chosen
    # Aged jobs just admitted run next step too: their keys count as running.
    counts: Counter[ParamKey] = Counter({k: n for k, n in running.items() if n > 0})
    counts.update(p.key for p in chosen)
    fresh = [p for p in fifo if not aged(p)]
    return chosen + _fill_by_homogeneity(fresh, counts, slots - len(chosen))


@dataclass(slots=True)
class Window:
    """The time window an idle worker holds open so early jobs share one prefill.

    Why: prefill runs the whole prompt through the model, and on the sizes mlxq
    serves one forward pass over N prompts costs far less than N passes (the
    weights are read once, the matmuls get wider). When the worker is idle and a
    first job arrives, it waits a moment for more, then prefills them together.
    The wait is bounded twice: by ``window_s`` from the first arrival, which
    later arrivals never extend, and by ``max_batch`` pending jobs, since a full
    batch gains nothing from waiting.

    Recommended: ``window_s=0.020`` (20 ms, about one decode step of a small
    model, so the first job loses at most a token's worth of latency) with
    ``max_batch=32`` on CPU and ``64`` on a GPU, where a pass stays near
    memory-bound to larger batches. ``window_s=0`` disables the window.

    Usage: ``open(now)`` on the first arrival while idle; while not
    ``should_close(now, len(pending))``, block on the queue for at most
    ``remaining(now)`` seconds; then ``close()`` and prefill. ``now`` is any
    monotonic clock in seconds, e.g. ``time.monotonic()``.

    Args:
        window_s: Longest wait in seconds after the first arrival; finite, >= 0.
        max_batch: Pending jobs that close the window early; >= 1.

    Raises:
        ValueError: naming the field and the bad value.
    """

    window_s: float
    max_batch: int
    opened_at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        w = self.window_s
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"window_s={w!r}: must be a finite number of seconds >= 0")
        self.window_s = float(w)
        _check_int("max_batch", self.max_batch, 1)

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def open(self, now: float) -> None:
        """Start the window at ``now``; a no-op when already open, so a steady
        trickle of arrivals cannot hold the first job back forever."""
        if self.opened_at is None:
            self.opened_at = now

    def close(self) -> None:
        """End the window (the batch is going to prefill)."""
        self.opened_at = None

    def remaining(self, now: float) -> float:
        """Seconds left to wait: in ``[0, window_s]``; 0 when closed.

        Clamped both ways, so a clock read before ``open`` cannot stretch the wait.
        """
        if self.opened_at is None:
            return 0.0
        return min(self.window_s, max(0.0, self.opened_at + self.window_s - now))

    def should_close(self, now: float, pending_count: int) -> bool:
        """Whether to stop waiting and prefill: the deadline has passed, or
        ``pending_count`` fills a batch. A closed window never holds jobs back."""
        return pending_count >= self.max_batch or self.remaining(now) == 0.0
