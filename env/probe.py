"""The acceptance probe: a few cheap speculative steps where acceptance is unmeasured.

While a stream runs without speculation, no acceptance is measured: the features keep
their prior (0.7 for the first draft position) or an estimate made under other
traffic, and a policy that prices speculation on that guess may stay off for good. On
the H200 dense server at 64 clients (batch 48) the prior prices depth 3 22% below off
where the draft accepts 0.99 and depth 3 serves 1.07x off: the shipped policy is off on
every step from a cold start (``docs/POLICY_PROBE.md``).

The probe is a deterministic rule over the policy's decision table, run on the
telemetry alone (:class:`ProbeTracker`, folded with each record by
:class:`env.features.FeatureBuilder`): every decode step run without speculation while
the stream's acceptance is stale (never measured, or not for ``stale_after`` decode
steps) earns ``share`` of its measured latency as a budget. Once the budget covers the
extra cost of ``steps`` steps at ``depth`` over off (the features' own latency
predictions at that step's batch: the handed cost profile corrected by measured
latencies), the decisions made on the next ``steps`` decode records replace every grid
row the policy left off (steps 0) with ``depth``; rows where the policy speculates keep
its choice. The first speculative step after off drafts from a cold state and the
features leave it out, so the default probe is two steps at depth 1: one to warm the
draft, one to measure. Once a speculative step is measured, the policy decides from
measured acceptance. So probing costs at most about ``share`` of the time spent off
(the same rule as ``goodput_greedy``'s hidden probe budget, :class:`agents.policies.
_GreedyRule`, made visible to every decider).

It reads only the features, so the simulator's evaluation
(:class:`agents.policies.ExportedPolicyAdapter`), ``specctl-serve`` and the plugin's
local mode (:mod:`controller.decider`) probe on exactly the same steps of the same
telemetry. The settings travel in the policy file (``probe`` in its meta; a file
without it gets :data:`DEFAULT_PROBE`); ``specctl-serve probe.enabled=false`` and
``specctl-eval probe.enabled=...`` (and the other fields) override them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:  # Python 3.11's; annotations only (requires-python is 3.10)
    from typing import Self


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class RuleSpec:
    """What a decision-layer rule's settings (a frozen dataclass: :class:`ProbeSpec`,
    :class:`env.guard.GuardSpec`) share: their form in a policy file's meta and their
    overrides (``specctl-serve`` / ``specctl-eval`` blocks named :attr:`label`)."""

    #: The block's name in a policy file and on the command lines.
    label: ClassVar[str]

    def to_dict(self) -> dict:
        """JSON-friendly copy (stored in a policy file's meta)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> Self:
        """Inverse of :meth:`to_dict`; unknown keys and bad values are an error."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.label}: expected an object, got {type(data).__name__}")
        return cls().override(data, keep_none=True)

    def override(self, changes: Mapping | None, keep_none: bool = False) -> Self:
        """This spec with the entries of ``changes`` (None entries ignored unless
        ``keep_none``); unknown fields are an error naming the block."""
        if not changes:
            return self
        given = {str(k): v for k, v in changes.items() if keep_none or v is not None}
        unknown = set(given) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"{self.label}: unknown fields {sorted(unknown)}")
        return dataclasses.replace(self, **given) if given else self


@dataclass(frozen=True)
class ProbeSpec(RuleSpec):
    """When and how a stream measures acceptance it does not know (see the module)."""

    label: ClassVar[str] = "probe"

    #: Off: the policy's decisions are sent unchanged.
    enabled: bool = True
    #: Speculation steps of a probe step (the smallest the policy and server offer at
    #: or above it, else the largest below).
    depth: int = 1
    #: Decode records whose decisions probe, once due (the first step back drafts cold).
    steps: int = 2
    #: Share of the time spent off, while acceptance is stale, that probing may cost.
    share: float = 0.01
    #: Decode steps after the last measured acceptance from which it counts as stale.
    stale_after: int = 2000

    def __post_init__(self) -> None:
        checks = (("enabled", isinstance(self.enabled, bool), "true or false"),
                  ("depth", _int(self.depth) and 1 <= self.depth <= 127, "an int in 1..127"),
                  ("steps", _int(self.steps) and 1 <= self.steps <= 64, "an int in 1..64"),
                  ("share", _number(self.share) and 0.0 < self.share <= 1.0,
                   "a number in (0, 1]"),
                  ("stale_after", _int(self.stale_after) and self.stale_after >= 0,
                   "an int >= 0"))
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"probe.{name}: {getattr(self, name)!r} is not {expected}")

    def action_index(self, actions: np.ndarray, allowed: np.ndarray | None) -> int | None:
        """Index into ``actions`` of the probe's steps: the smallest allowed speculative
        action >= ``depth``, else the largest allowed one below it; None if none is."""
        usable = actions > 0
        if allowed is not None:
            usable &= allowed
        if not usable.any():
            return None
        candidates = np.flatnonzero(usable)
        steps = actions[candidates]
        above = steps >= self.depth
        if above.any():
            return int(candidates[above][np.argmin(steps[above])])
        return int(candidates[np.argmax(steps)])


#: The probe of a policy file that does not set one.
DEFAULT_PROBE = ProbeSpec()
#: No probe: the policy's decisions unchanged.
NO_PROBE = ProbeSpec(enabled=False)


class ProbeTracker:
    """One stream's probe budget, folded record by record with its features."""

    __slots__ = ("budget_s", "cost_s", "remaining", "spec")

    def __init__(self, spec: ProbeSpec) -> None:
        self.spec = spec
        self.reset()

    def reset(self) -> None:
        """Forget the budget (a new stream)."""
        self.budget_s = 0.0
        self.cost_s = 0.0  # the latest estimate of a probe's extra cost
        self.remaining = 0  # decode records whose decisions still probe

    def copy(self) -> ProbeTracker:
        """An independent copy (the daemon evaluates a copy of a stream's features)."""
        new = ProbeTracker(self.spec)
        new.budget_s, new.cost_s, new.remaining = self.budget_s, self.cost_s, self.remaining
        return new

    def fold(self, steps_used: int, latency_s: float, features, batch: int) -> None:
        """One decode record of ``batch`` requests at ``steps_used``, after ``features``
        (its :class:`env.features.FeatureBuilder`) folded it. Cheap unless the stream is
        off with stale acceptance: the daemon folds every record of every stream."""
        if self.remaining:
            self.remaining -= 1
            return
        if steps_used or latency_s <= 0.0:
            return
        spec = self.spec
        age, measured = features.acceptance_age()
        if measured and age < spec.stale_after:
            self.budget_s = 0.0  # fresh: nothing to measure
            return
        self.budget_s += spec.share * latency_s
        if self.budget_s < self.cost_s:
            return
        # The features' own prediction (the handed profile corrected by measured
        # latencies) of one step at the probe's depth over off, at this batch.
        predicted = features.latency_predictions_s(batch)
        extra = predicted[min(spec.depth, len(predicted) - 1)] - predicted[0]
        self.cost_s = spec.steps * max(float(extra), 0.0)
        if self.budget_s >= self.cost_s:
            self.budget_s = 0.0
            self.remaining = spec.steps


def probe_rows(index: np.ndarray, actions: np.ndarray, probe_index: int) -> None:
    """In place: every entry of ``index`` (action indices) whose action is 0 becomes
    ``probe_index``."""
    index[actions[index] == 0] = probe_index


def apply_probe(probe: ProbeSpec, index: np.ndarray, actions: np.ndarray,
                probing: Sequence[bool], allowed: Sequence[np.ndarray | None]) -> None:
    """In place: the rows (shape (streams, grid rows)) of the streams ``probing`` says
    are due, probed (:func:`probe_rows`); the one place both deciders and the simulator's
    policy adapter change a decision."""
    for i, due in enumerate(probing):
        if due:
            target = probe.action_index(actions, allowed[i])
            if target is not None:
                probe_rows(index[i], actions, target)
