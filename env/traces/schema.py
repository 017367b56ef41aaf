"""The telemetry schema: one record per scheduler step and one per request.

This module is the single source of truth for field names. The Parquet trace
format (:mod:`env.traces.trace_format`), the ZeroMQ wire protocol (:mod:`controller.wire`),
the SGLang hooks that produce records and the feature module that consumes them
(:mod:`env.features`) all use these names, so a record the simulator emits and
a record a real server sends are interchangeable.

It imports numpy only, so the SGLang hooks and the controller can use it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: Version of the record schema, shared by the trace format and the wire protocol.
SCHEMA_VERSION = 1


@dataclass(slots=True)
class StepRecord:
    """What one scheduler step looked like, as the SGLang hooks see it.

    A decode step has ``prefill_tokens == 0``; a prefill (extend) step has
    ``prefill_tokens > 0`` and no speculation (``steps_used == 0``).

    Attributes:
        server: Name of the SGLang server that ran the step.
        rank: Tensor-parallel rank that reported it.
        step_index: Scheduler step counter, strictly increasing per (server, rank).
        time_s: Time the step was launched, in seconds (monotonic clock).
        batch_size: Requests in the step's batch.
        waiting_requests: Requests queued, not yet admitted, at launch.
        running_requests: Requests admitted (decoding or prefilling) at launch.
        kv_used_tokens: KV-cache slots in use at launch.
        kv_capacity_tokens: KV-cache slots in all.
        prefill_tokens: Prompt tokens computed in this step (0 for a decode step).
        steps_used: Draft depth (``speculative_num_steps``) of this step; 0 = none.
        accepted_drafts: Accepted draft tokens per request of the batch (int8),
            empty when the step did not speculate.
        step_latency_s: Wall time of the step: from the previous step's processed result
            to this step's (under overlap scheduling, launch-to-launch would time the
            step before).
        request_ids: Request ids of the batch, in order (recorded traces only).
        prefill_pairs: A prefill step's attention token pairs, summed over its prompts
            (each new token attends to every earlier token of its prompt, cached prefix
            and earlier chunks included: ``env.sim.cost_model.prefill_pairs``); None
            where not recorded.
        warmup: Whether this depth-0 decode step was the plugin's re-entry warm-up (the
            first step asked for depth > 0 after an off period, run as SGLang's steps=0
            on the speculative path: a verify forward and the draft extend,
            ``sglang_hooks.offswitch.OffSwitch.choose``), not an off step. True only on
            a decode record with ``steps_used == 0``; False on every other record of a
            stream that knows (the plugin with its off path, the simulator on
            ``zero_step="off"``); None where unknown (an older plugin or trace, or a
            server whose depth-0 steps are SGLang's own steps=0): the features then
            infer it (``FeatureSpec.drop_warmup_latency``).
        before_prefill: Whether the batch launched right after this step was a prefill
            (extend) step, launched before this step's result was processed (SGLang's
            overlap scheduler): this step's latency then carries the prefill's launch.
            Known to the plugin (always False without overlap scheduling) and the
            simulator; None where unknown (an older plugin or trace): the features then
            take the next record's kind for it (``FeatureSpec.latency_drop_before_prefill``).
    """

    server: str
    rank: int
    step_index: int
    time_s: float
    batch_size: int
    waiting_requests: int
    running_requests: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    prefill_tokens: int
    steps_used: int
    accepted_drafts: np.ndarray
    step_latency_s: float
    request_ids: list[str] | None = field(default=None)
    prefill_pairs: float | None = field(default=None)
    warmup: bool | None = field(default=None)
    before_prefill: bool | None = field(default=None)

    @property
    def is_decode(self) -> bool:
        """True for a decode (possibly speculative) step."""
        return self.prefill_tokens == 0

    @property
    def kv_use(self) -> float:
        """Fraction of the KV cache in use, in [0, 1]."""
        if self.kv_capacity_tokens <= 0:
            return 0.0
        return min(1.0, self.kv_used_tokens / self.kv_capacity_tokens)

    @property
    def accepted_drafts_sum(self) -> int:
        """Accepted draft tokens summed over the batch."""
        return int(self.accepted_drafts.sum(dtype=np.int64))

    @property
    def accepted_drafts_count(self) -> int:
        """Requests whose acceptance is reported."""
        return int(self.accepted_drafts.size)

    @property
    def output_tokens(self) -> int:
        """Tokens committed by this step: one per request plus accepted drafts."""
        if not self.is_decode:
            return 0
        return self.batch_size + self.accepted_drafts_sum


@dataclass(slots=True)
class RequestRecord:
    """One request of a workload or a recorded trace.

    Attributes:
        request_id: Unique id within the trace.
        arrival_s: Arrival time in seconds from the start of the trace.
        prompt_tokens: Prompt (context) length in tokens, >= 1.
        output_tokens: Generated tokens, >= 1.
        request_class: Optional category (e.g. a Spec-Bench category).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    request_class: str | None = None


#: StepRecord fields in their canonical order, as stored and sent.
STEP_FIELDS: tuple[str, ...] = tuple(StepRecord.__dataclass_fields__)
#: RequestRecord fields in their canonical order.
REQUEST_FIELDS: tuple[str, ...] = tuple(RequestRecord.__dataclass_fields__)
