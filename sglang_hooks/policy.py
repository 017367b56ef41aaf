"""The adaptive policy SGLang asks for every decode step's speculation depth.

:func:`make_policy_class` subclasses SGLang's ``AdaptiveSpeculativeParams``
(same constructor, so ``EAGLEWorkerV2`` builds it unchanged in 0.5.15.post1
and 0.5.23). ``get_steps_for_batch`` returns, in order of precedence:

1. the applied controller decision (:attr:`Runtime.controller`), for this batch size;
2. otherwise the local rule, identical on every rank: ``sglang`` (the superclass,
   SGLang's own acceptance-EMA rule, fed the same verify results on every rank),
   ``table`` (a static batch size -> steps table) or ``explore`` (record mode:
   cycle through every candidate depth, ``dwell`` steps each, in an order that
   is a fixed function of the step index).

The result is clamped to the candidate steps SGLang built runtime states for
(asking for another one would raise in ``AdaptiveController._activate``);
clamps are counted. ``on_verify_complete`` never asks for an immediate switch
(it returns None): every switch happens when the next batch is launched.
"""

from __future__ import annotations

import bisect
import random

from sglang_hooks.runtime import Runtime

_STEP_RANGE = 128  # steps a decision may name (int8 on the wire)


def _nearest(candidates: list[int]) -> tuple[int, ...]:
    """For every requested step 0..127, the closest candidate (ties: the smaller)."""
    return tuple(min(candidates, key=lambda c: (abs(c - s), c)) for s in range(_STEP_RANGE))


def make_policy_class(base: type, runtime: Runtime) -> type:
    """A subclass of SGLang's ``AdaptiveSpeculativeParams`` bound to ``runtime``."""
    table_sizes = [size for size, _ in runtime.cfg.table]
    table_steps = [steps for _, steps in runtime.cfg.table]
    rule = runtime.cfg.rule
    dwell = runtime.cfg.explore_dwell

    class SpecctlAdaptiveParams(base):
        """SGLang's adaptive params, with steps chosen by specctl (see module docstring)."""

        _specctl: Runtime = runtime

        def __init__(self, initial_steps: int, cfg_path: str | None = None) -> None:
            super().__init__(initial_steps, cfg_path)
            per_slot = {bs: tuple(slot.candidate_steps) for bs, slot in self._slots.items()}
            self._specctl_nearest = {id(slot): _nearest(list(per_slot[bs]))
                                     for bs, slot in self._slots.items()}
            # The shipped config offers the same steps at every batch size: skip routing.
            self._specctl_uniform = (
                _nearest(list(next(iter(per_slot.values()))))
                if len(set(per_slot.values())) == 1 else None
            )
            self._specctl_order: list[int] = []
            self._specctl_cycle = -1
            self._specctl.attach_policy(self)

        def get_steps_for_batch(self, batch_size: int) -> int:
            rt = self._specctl
            try:
                decision = rt.controller
                if decision is not None:
                    want = decision.steps_for(batch_size)
                elif rule == "table":
                    index = bisect.bisect_right(table_sizes, batch_size) - 1
                    want = table_steps[index if index > 0 else 0]
                elif rule == "explore":
                    want = self._explore(rt.launch_step)
                else:
                    want = super().get_steps_for_batch(batch_size)
                nearest = (self._specctl_uniform
                           or self._specctl_nearest[id(self._route(batch_size))])
                steps = nearest[want if want < _STEP_RANGE else _STEP_RANGE - 1]
                if steps != want:
                    rt.counters["clamped"] += 1
            except Exception as exc:
                rt.fault("policy", exc)
                steps = super().get_steps_for_batch(batch_size)
            # The off switch may turn the first step back on into SGLang's steps=0 (a
            # warm-up for the draft); telemetry reports the steps that actually ran.
            if rt.offswitch is not None:
                steps = rt.offswitch.choose(steps)
            rt.last_steps = steps
            return steps

        def on_verify_complete(self, num_correct_drafts_per_req: list[int],
                               batch_size: int) -> int | None:
            rt = self._specctl
            if rule == "sglang" and rt.controller is None:
                try:  # keep SGLang's rule current while it is in charge
                    super().on_verify_complete(num_correct_drafts_per_req, batch_size)
                except Exception as exc:
                    rt.fault("policy", exc)
            rt.on_verify(num_correct_drafts_per_req)
            return None

        def _explore(self, step: int) -> int:
            candidates = self.candidate_steps
            cycle, position = divmod(step // dwell, len(candidates))
            if cycle != self._specctl_cycle:
                # A fresh order each cycle, so every depth follows every other one.
                self._specctl_order = random.Random(cycle).sample(candidates, len(candidates))
                self._specctl_cycle = cycle
            return self._specctl_order[position]

    if runtime.clock is not None:  # SPECCTL_HOOK_TIMING: count these on the scheduler thread
        for name in ("get_steps_for_batch", "on_verify_complete"):
            setattr(SpecctlAdaptiveParams, name,
                    runtime.clock.plain(getattr(SpecctlAdaptiveParams, name)))
    return SpecctlAdaptiveParams

