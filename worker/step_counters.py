"""What a worker's decode batch and its prefills did: passes, rows, the prompt cache, pauses,
constraints, the batch's slots, and the decode thread's time by stage. One object, shared
by the engine, its generator and every batch they make."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from mlxq.worker.stages import Stages


@dataclass
class StepCounters:
    #: The batch's model passes of one token a row, each sampled in one call.
    decode_steps: int = 0
    #: Of those, the passes new rows took for their first token alone (rows that ride
    #: take none: :meth:`mlxq.worker.generator.Generator.ride`; nor do rows whose prefill
    #: fed their last prompt token: ``first_tokens_from_prefill`` counts those rows, whose
    #: first tokens are sampled in one call, not in a step).
    first_token_passes: int = 0
    first_tokens_from_prefill: int = 0
    #: New rows whose prompt ran in the batch's decode pass (:mod:`mlxq.worker.fused_pass`):
    #: no pass of their own.
    fused_prefills: int = 0
    vectorized_steps: int = 0
    sampler_calls: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    #: Prompt cache: rows looked up, rows that found a prefix, the tokens those held,
    #: and prompt tokens run through the model (rows' rests and shared prefixes).
    prompt_cache_queries: int = 0
    prompt_cache_hits: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_prefilled: int = 0
    #: Rows taken out of the batch with their KV for a while, rows put back, and the
    #: tokens prefilled again for rows put back without their KV.
    preemptions: int = 0
    resumes: int = 0
    resume_tokens_recomputed: int = 0
    #: Rows that joined the decoding batch by writing into the slots of rows that had left
    #: (:mod:`mlxq.worker.kv_slots`), rows that joined by a copy of every row's caches,
    #: and the times the batch gathered its live slots, dropping the dead.
    rows_joined_in_place: int = 0
    rows_joined_by_copy: int = 0
    slot_gathers: int = 0
    #: Rows that decoded under a constraint, constraints compiled for this model (each
    #: once, then cached), and milliseconds the decode thread spent filling their masks.
    constrained_rows: int = 0
    constraint_compiles: int = 0
    mask_ms: float = 0.0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    #: Prefill forward passes by rows (how many passes prefilled that many prompts at
    #: once), and the distinct (rows, padded length, keys attended) shapes among them
    #: (a row with a cached prefix attends to it too): each new shape
    #: may cost a GPU backend a kernel build or an attention plan.
    prefill_batch_sizes: dict[int, int] = field(default_factory=dict)
    prefill_shapes: set[tuple[int, int, int]] = field(default_factory=set)
    #: The decode thread's time by stage (:mod:`mlxq.worker.stages`).
    stages: Stages = field(default_factory=Stages.from_env)
    #: Every prefill shape this process met, and (while tracing) decode batch size; kept by
    #: :meth:`reset` (the stage trace marks a pass of a shape new to the process).
    seen: set[tuple[int, ...]] = field(default_factory=set)

    def reset(self) -> None:
        """Every count back to zero, in place (batches hold this object); the stage trace
        goes on, and the shapes seen are kept."""
        for f in fields(self):
            if f.name == "seen":
                continue
            if f.name == "stages":
                self.stages.ms.clear()
            elif f.default_factory is not MISSING:
                setattr(self, f.name, f.default_factory())
            else:
                setattr(self, f.name, f.default)

    def count_prefill(self, rows: int, length: int, keys: int) -> None:
        """One prefill pass over ``rows`` prompts, right-padded to ``length`` tokens,
        attending to ``keys`` positions (what the rows' caches held before, and these)."""
        self.prefill_batch_sizes[rows] = self.prefill_batch_sizes.get(rows, 0) + 1
        shape = (rows, length, keys)
        self.stages.note(rows=rows, width=length, keys=keys, new=shape not in self.seen)
        self.prefill_shapes.add(shape)
        self.seen.add(shape)

    def count_step(self, rows: int, sampler_calls: int) -> None:
        """One decode step of ``rows`` rows, which called the sampler that many times."""
        self.decode_steps += 1
        self.sampler_calls += sampler_calls
        self.vectorized_steps += sampler_calls == 1
        self.batch_sizes[rows] = self.batch_sizes.get(rows, 0) + 1
