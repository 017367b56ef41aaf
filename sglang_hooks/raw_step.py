"""A step's values as the source rank's hooks read them, and the telemetry they make.

The scheduler thread only reads what SGLang will have changed after the hook returns
and keeps it as it read it: one tuple at launch (:data:`LAUNCH_FIELDS`), one at the
result (:data:`STEP_FIELDS`, the launch's tuple inside). Everything derived from those
values (running requests after an extend, KV use, prefill tokens, the steps a step
used, its latency) is computed by :func:`telemetry_of` on the thread that consumes the
step: the controller client's I/O thread and the recorder's thread. The telemetry is
the same tuple the hooks built before (the arguments of
:func:`sglang_hooks.client.telemetry_frame`).
"""

from __future__ import annotations

#: A launch this long after the previous step's result means the server sat idle.
IDLE_GAP_S = 0.05

#: The launch tuple, in order. ``running``: the running batch's requests before this
#: batch; ``available`` + ``evictable``: free KV (the allocator's, the tree cache's);
#: ``extend_tokens``: an extend batch's ``extend_num_tokens`` (None for decode);
#: ``requests``: the batch's request list itself (recording only; its first
#: ``batch_size`` entries are the requests launched, see :func:`request_copies`);
#: ``prefix_lens`` / ``extend_lens``: copies of an extend batch's lists (recording only,
#: else None).
LAUNCH_FIELDS = ("step", "time_s", "is_decode", "batch_size", "waiting", "running",
                 "capacity", "available", "evictable", "extend_tokens", "requests",
                 "prefix_lens", "extend_lens")
#: The step tuple handed over after the result: its launch tuple, the depth the step
#: ran (-1: the policy was not asked), SGLang's per-request accepted drafts (None: not
#: verified), when its result was processed, when the previous result was (None:
#: no previous one), whether it was the off switch's re-entry warm-up (None: not
#: known, the off path is not in use; a tuple without it reads as None), and whether the
#: batch launched before its result was processed was a prefill (``StepRecord.
#: before_prefill``; a tuple without it reads as None).
STEP_FIELDS = ("launch", "ran", "accepted", "result_s", "previous_result_s", "warmup",
               "before_prefill")


def telemetry_of(server: str, rank: int, step: tuple) -> tuple:
    """The telemetry tuple of a step tuple (:data:`STEP_FIELDS`): server, rank, step
    index, launch time, batch size, waiting, running, KV used, KV capacity, prefill
    tokens, steps used, accepted drafts, latency, warm-up flag, before-prefill flag."""
    launch, ran, accepted, now, start = step[:5]
    warmup = step[5] if len(step) > 5 else None
    before_prefill = step[6] if len(step) > 6 else None
    (index, t_launch, is_decode, batch_size, waiting, running, capacity, available,
     evictable, extend_tokens) = launch[:10]
    # A step's latency is the time between consecutive results. Under overlap
    # scheduling, step N+1 is launched before N's result is processed, so the
    # launch-to-launch period would measure step N-1; result to result measures N (and
    # equals the loop period without overlap). After an idle gap the step's own launch
    # is its start.
    if start is None or t_launch - start > IDLE_GAP_S:
        start = t_launch
    if is_decode:
        return (server, rank, index, t_launch, batch_size, waiting, running,
                max(0, capacity - (available + evictable)), capacity, 0,
                ran if ran > 0 else 0, accepted, now - start, warmup, before_prefill)
    # An extend step's requests are running too, it used no draft steps, and it computes
    # at least one token per request (a record with no prefill tokens would read as a
    # decode step).
    return (server, rank, index, t_launch, batch_size, waiting, running + batch_size,
            max(0, capacity - (available + evictable)), capacity,
            extend_tokens or batch_size or 1, 0, accepted, now - start,
            False if warmup else warmup,  # (never a warm-up: the flag at steps 0 only)
            before_prefill)


def request_copies(step: tuple) -> tuple[list | None, tuple[list, list] | None]:
    """What a step tuple holds for the recorder: a copy of the requests launched (None:
    not recording) and an extend step's (prefix lengths, new tokens) copies (None: a
    decode step, not recording, or a batch without the lists).

    The launch kept the batch's list itself; its first ``batch_size`` entries are the
    requests launched however long ago that was, because SGLang changes a batch's list
    in place only by appending (:data:`sglang_hooks.contract.APPEND_ONLY`). The copy is
    made here, on the consumer's thread, not by the hook (a slice is one C call under
    the GIL: an append on the scheduler thread lands before or after it, not inside)."""
    launch = step[0]
    requests, prefix = launch[10], launch[11]
    return (None if requests is None else requests[:launch[3]],
            (prefix, launch[12]) if prefix is not None else None)
