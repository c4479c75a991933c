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

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from mlxq.producer.params import ParamKey
from mlxq.producer.validate import at_least


class Waiting(Protocol):
    """What admission reads of a waiting job (a :class:`Pending`, or the worker's own
    job record)."""

    @property
    def job_id(self) -> str: ...

    @property
    def key(self) -> ParamKey: ...

    @property
    def arrived_step(self) -> int: ...


W = TypeVar("W", bound=Waiting)


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
        at_least("max_batch", self.max_batch, 1)
        at_least("max_wait_steps", self.max_wait_steps, 0)


def _check_call(
    pending: Sequence[Waiting],
    running: Mapping[ParamKey, int],
    free_slots: int,
    step: int,
    policy: AdmissionPolicy,
) -> None:
    at_least("free_slots", free_slots, 0)
    if free_slots > policy.max_batch:
        raise ValueError(f"free_slots={free_slots!r}: more than max_batch={policy.max_batch}")
    at_least("step", step, 0)
    for key, count in running.items():
        at_least(f"running[{key!r}]", count, 0)
    # A job dated in the future would never age: its wait bound would be void.
    late = next((p for p in pending if p.arrived_step > step), None)
    if late is not None:
        raise ValueError(
            f"arrived_step={late.arrived_step!r}: job {late.job_id} is after step={step}"
        )


def _fill_by_homogeneity(fresh: Sequence[W], counts: Counter[ParamKey], slots: int) -> list[W]:
    """Up to ``slots`` jobs of ``fresh`` (in FIFO order), running keys first,
    then larger key groups, oldest first inside a key."""
    groups: dict[ParamKey, list[W]] = {}
    for p in fresh:
        groups.setdefault(p.key, []).append(p)
    # The sort is stable and ``groups`` is in order of each key's oldest job,
    # so equal ranks go to the key that has waited longest.
    order = sorted(groups, key=lambda k: (counts[k] == 0, -(counts[k] + len(groups[k]))))
    chosen: list[W] = []
    for key in order:
        chosen.extend(groups[key][: slots - len(chosen)])
        if len(chosen) == slots:
            break
    return chosen


def admit(
    pending: Sequence[W],
    running: Mapping[ParamKey, int],
    free_slots: int,
    step: int,
    policy: AdmissionPolicy,
) -> list[W]:
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

    def aged(p: W) -> bool:
        return step - p.arrived_step >= policy.max_wait_steps

    chosen = [p for p in fifo if aged(p)][:slots]
    if len(chosen) == slots:
        return chosen
    # Aged jobs just admitted run next step too: their keys count as running.
    counts: Counter[ParamKey] = Counter({k: n for k, n in running.items() if n > 0})
    counts.update(p.key for p in chosen)
    fresh = [p for p in fifo if not aged(p)]
    return chosen + _fill_by_homogeneity(fresh, counts, slots - len(chosen))
