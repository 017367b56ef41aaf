"""The acceptance probe: a few cheap speculative steps where acceptance is unmeasured;
the off probe: a few off steps where off's cost is unmeasured; and the cost probe: a few
steps at a depth whose cost is unmeasured.

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

**The start probe** (``start_probe`` > 0; 0, the default, is none) makes that probe due at
a stream's start, for its first ``start_probe`` decode records, before any budget: a
stream that goes off on its first decision (on the prior, at a full batch) leaves every
running request with stale draft state (the plugin's off path keeps no draft KV for
tokens decoded while off), so the budgeted probe, ~2 s of off steps later, measures only
their stale acceptance, and the stream may stay off where speculation from the start
pays (``docs/results/gpu27/README.md``, ``docs/results/startprobe28/``). It probes only the
rows (batch sizes) where some speculative depth could pay at a high acceptance
(``start_accept`` of every draft position, 0.9: its predicted latency under the tokens a
step would commit, times off's): on a server where a depth-1 step costs 6x off and depth
7 7x (``blackwell_tp8`` at 64 requests) there is nothing to learn, and five probing steps
cost 5% of a window. Only a stream with a cost profile runs it: without one the latency
predictions it would judge by are priors (its second candidate lost up to 0.14 of the
oracle in no-profile windows of ``blackwell_tp8`` and random servers), and the start rule
and the cost probe cover that start. Where the policy speculates on those records anyway
(a first request alone), the probe changes nothing.

**The off probe** (``off_share`` > 0; 0, the default, is none, so a policy file without
it decides as before) is the mirror image, for off's cost: while a stream speculates, no
step measures what off costs at its batch size, and where the handed profile is another
server's (its per-term misfit: off at 64 requests predicted at 20.7 ms, truly 4.7, while
the depth run is predicted right) or there is none (off measured at batch 1-2 and
extrapolated to 64: 43-79 ms, truly 23), the policy speculates where it loses 0.33-0.8x no
speculation (``docs/POLICY.md``, fourteenth session). Every speculative decode step, while
off has fewer than ``off_samples`` recent measurements near the stream's batch size
(:meth:`ProbeTracker.off_coverage`: per power-of-two batch bucket, forgotten as the
latency regression forgets, half weight from the neighbouring buckets), earns
``off_share`` of its measured latency; once that covers ``off_steps`` off steps at the
features' predicted off latency, the decisions made on the next ``off_steps`` decode
records replace every row the policy speculates on with off. The first off step measured
afterwards is compared with the prediction the probe was started on: within
``off_confirm`` (a log ratio), off's prediction at that batch bucket is confirmed and the
stream does not probe there again (an exact profile: one probe per batch bucket); off
otherwise, the measurement corrects the features and the probe may return once it is
forgotten. ``off_trust`` (0: none) holds the off probe back while the measured steps sit
that close to a handed profile (a mean log ratio): in the simulator an exact profile sits
at 0, but on the real H200 traces the shipped profiles sit within 0.05 on 22% of the
decode steps only (``docs/POLICY.md``, fourteenth session). ``off_unprofiled`` (1: the
same) scales ``off_share`` for a stream without a cost profile: there every off step
makes the requests running through it decode with stale draft state (the plugin's off
path), and in the simulator's re-entry draws that lasting loss is what an off probe at
a full batch can cost (``docs/results/nopro24/``, ``docs/results/nopro26/``).
``enabled: false`` turns both probes off.

**The cost probe** (``cost_depth`` > 0; 0, the default, is none) measures a depth's cost
where the stream has not run it, for a stream without a cost profile. Without one the
latency regression extrapolates a depth's cost across batch sizes from where it ran: on
the H200 MoE (run 86) depth 3 measured at batch 8-48 was priced at 18-22 ms at batch 1-3,
where it costs 9.4 (off 4.6), and the policy ran off on 98% of those steps where depth 3
pays (``docs/OFFSWITCH.md``, runs 85-90). Every off step, while fewer than
``cost_samples`` recent steps at ``cost_depth`` or deeper ran near the batch size (the
off probe's buckets and forgetting), earns ``cost_share`` of its latency; once that covers
``steps`` steps at ``cost_depth`` over off (the features' prediction), the decisions made
on the next ``steps`` decode records replace every row the policy left off with
``cost_depth`` (the first of them the plugin's re-entry warm-up, the next measured). The
first step at ``cost_depth`` measured afterwards is compared with the prediction the probe
started on: within ``off_confirm`` (a log ratio), the depth's prediction at that batch
bucket is confirmed and the stream does not cost-probe there again (where speculation
never pays, the probe would otherwise return whenever the measurement is forgotten). A
``cost_doubt`` (0: none) skips a probe where the depth would not pay even at that fraction of
its predicted latency (its expected tokens per step, from the measured acceptance, times
off's latency below it): where speculation never pays, each probe at a full batch cost
5.7x an off step (the MoE at acceptance 1.1, batch 64: 136 ms against 24). A
stream with a profile does not cost-probe: the profile prices every depth at every batch
size, measurements correct it, and the off probe covers a wrong one; with
``cost_untrusted`` set it does while its measurements sit further than that from the
profile (the correction, an additive residual fitted where the stream ran, can misprice a
depth elsewhere by several times: ``docs/results/untrusted28/``).

It reads only the features, so the simulator's evaluation
(:class:`agents.policies.ExportedPolicyAdapter`), ``specctl-serve`` and the plugin's
local mode (:mod:`controller.decider`) probe on exactly the same steps of the same
telemetry. The settings travel in the policy file (``probe`` in its meta; a file
without it gets :data:`DEFAULT_PROBE`); ``specctl-serve probe.enabled=false`` and
``specctl-eval probe.enabled=...`` (and the other fields) override them.
"""

from __future__ import annotations

import dataclasses
import math
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
    #: The off probe (see the module): share of the time spent speculating, while off's
    #: cost is unmeasured at the batch size, that off steps may take. 0: no off probe.
    off_share: float = 0.0
    #: Decode records whose decisions run off, once an off probe is due.
    off_steps: int = 2
    #: Recent off measurements near the batch size (forgotten as the latency regression
    #: forgets) below which off's cost there counts as unmeasured.
    off_samples: float = 0.5
    #: |log(measured / predicted)| of the probe's first off step within which off's
    #: prediction at that batch bucket is confirmed (no further off probe there).
    off_confirm: float = 0.15
    #: With a profile handed, no off probe while the measured steps sit within this of
    #: its predictions (the mean log ratio, ``cost_profile_error``): 0, probe whatever
    #: the profile error (another server's profile can price the depth run within 7%
    #: and off 4x too high).
    off_trust: float = 0.0
    #: The off probe's share in a stream without a cost profile, as a fraction of
    #: ``off_share`` (1: the same; 0: no off probe without a profile).
    off_unprofiled: float = 1.0
    #: The cost probe (see the module): while a stream runs off, the depth whose cost it
    #: measures where no step at this depth or deeper ran near the batch size. 0: none.
    cost_depth: int = 0
    #: Share of the time spent off, while that depth's cost is unmeasured at the batch
    #: size, that the cost probe's steps may cost (over off).
    cost_share: float = 0.05
    #: Recent steps at ``cost_depth`` or deeper near the batch size (forgotten as the
    #: latency regression forgets) below which that cost counts as unmeasured.
    cost_samples: float = 0.5
    #: How far off the features' price of ``cost_depth`` may be: no cost probe where, at
    #: ``1 / cost_doubt`` of its predicted latency, that depth would still not pay (its
    #: expected tokens per step, 1 + accepted drafts, times off's latency below it). 0: no
    #: such check.
    cost_doubt: float = 0.0
    #: The cost probe in a stream with a cost profile too, while the measured latencies
    #: sit further than this from the profile's predictions (``|profile_log_error|``, a
    #: mean log ratio): there the features' correction of the profile, fitted where the
    #: stream ran, can misprice a depth at another batch size by several times. 0, the
    #: default: never with a profile.
    cost_untrusted: float = 0.0
    #: The start rule (see the module; 0, the default, is none): in a stream without a
    #: cost profile, while no speculative depth holds a cost sample, once one speculative
    #: step decided has run (not the warm-up after off), every decision is off until a
    #: speculative sample arrives, for at most this many decisions (then another try);
    #: and no decision of that phase is held by the plugin's switch hold.
    start_off: int = 0
    #: With ``start_off``: the shallowest speculative depth whose unmeasured step the
    #: start rule turns off after (0, the default: every depth, as before the field). A
    #: decided step shallower than this (a cheap first try, as the cost probe's depth 1)
    #: runs as without the rule, held by the switch hold, and is not counted; only the
    #: decisions at this depth or deeper and the off ones the rule forces are unheld.
    start_depth: int = 0
    #: The acceptance probe at a stream's start (0, the default, is none): a new stream's
    #: decisions probe, as a due acceptance probe does, until this many decode records
    #: have been folded, so acceptance is measured before any off step leaves the running
    #: requests with stale draft state.
    start_probe: int = 0
    #: With ``start_probe``: the start probe probes a row (a batch size) only where some
    #: speculative depth would pay at this acceptance of every draft position (its
    #: predicted latency under the tokens a step would commit, times off's).
    start_accept: float = 0.9

    def __post_init__(self) -> None:
        checks = (("enabled", isinstance(self.enabled, bool), "true or false"),
                  ("depth", _int(self.depth) and 1 <= self.depth <= 127, "an int in 1..127"),
                  ("steps", _int(self.steps) and 1 <= self.steps <= 64, "an int in 1..64"),
                  ("share", _number(self.share) and 0.0 < self.share <= 1.0,
                   "a number in (0, 1]"),
                  ("stale_after", _int(self.stale_after) and self.stale_after >= 0,
                   "an int >= 0"),
                  ("off_share", _number(self.off_share) and 0.0 <= self.off_share <= 1.0,
                   "a number in [0, 1]"),
                  ("off_steps", _int(self.off_steps) and 1 <= self.off_steps <= 64,
                   "an int in 1..64"),
                  ("off_samples", _number(self.off_samples) and 0.0 < self.off_samples
                   < math.inf, "a positive number"),
                  ("off_confirm", _number(self.off_confirm) and 0.0 <= self.off_confirm
                   < math.inf, "a number >= 0"),
                  ("off_trust", _number(self.off_trust) and 0.0 <= self.off_trust < math.inf,
                   "a number >= 0"),
                  ("off_unprofiled", _number(self.off_unprofiled)
                   and 0.0 <= self.off_unprofiled <= 1.0, "a number in [0, 1]"),
                  ("cost_depth", _int(self.cost_depth) and 0 <= self.cost_depth <= 127,
                   "an int in 0..127"),
                  ("cost_share", _number(self.cost_share) and 0.0 < self.cost_share <= 1.0,
                   "a number in (0, 1]"),
                  ("cost_samples", _number(self.cost_samples) and 0.0 < self.cost_samples
                   < math.inf, "a positive number"),
                  ("cost_doubt", _number(self.cost_doubt) and (self.cost_doubt == 0.0
                   or 1.0 <= self.cost_doubt < math.inf), "0 or a number >= 1"),
                  ("cost_untrusted", _number(self.cost_untrusted)
                   and 0.0 <= self.cost_untrusted < math.inf, "a number >= 0"),
                  ("start_off", _int(self.start_off) and 0 <= self.start_off <= 1024,
                   "an int in 0..1024"),
                  ("start_depth", _int(self.start_depth) and 0 <= self.start_depth <= 127,
                   "an int in 0..127"),
                  ("start_probe", _int(self.start_probe) and 0 <= self.start_probe <= 64,
                   "an int in 0..64"),
                  ("start_accept", _number(self.start_accept)
                   and 0.0 < self.start_accept <= 1.0, "a number in (0, 1]"))
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"probe.{name}: {getattr(self, name)!r} is not {expected}")

    def to_dict(self) -> dict:
        """As :meth:`RuleSpec.to_dict`, without ``off_unprofiled`` where it is 1, without
        ``cost_untrusted`` where it is 0, without
        ``start_off``, ``start_depth`` or ``start_probe`` where they are 0, and without
        ``start_accept`` where ``start_probe`` is 0 (a file written with them at those
        values is byte for byte what it was before the fields)."""
        data = super().to_dict()
        if self.off_unprofiled == 1.0:
            del data["off_unprofiled"]
        if self.cost_untrusted == 0.0:
            del data["cost_untrusted"]
        if self.start_off == 0:
            del data["start_off"]
        if self.start_depth == 0:
            del data["start_depth"]
        if self.start_probe == 0:  # start_accept means nothing without it
            del data["start_probe"], data["start_accept"]
        return data

    def off_share_of(self, has_profile: bool) -> float:
        """The off probe's share in a stream with or without a cost profile."""
        return self.off_share if has_profile else self.off_share * self.off_unprofiled

    def action_index(self, actions: np.ndarray, allowed: np.ndarray | None,
                     depth: int | None = None) -> int | None:
        """Index into ``actions`` of the probe's steps: the smallest allowed speculative
        action >= ``depth`` (default: the acceptance probe's), else the largest allowed one
        below it; None if none is."""
        depth = self.depth if depth is None else depth
        usable = actions > 0
        if allowed is not None:
            usable &= allowed
        if not usable.any():
            return None
        candidates = np.flatnonzero(usable)
        steps = actions[candidates]
        above = steps >= depth
        if above.any():
            return int(candidates[above][np.argmin(steps[above])])
        return int(candidates[np.argmax(steps)])


#: The probe of a policy file that does not set one.
DEFAULT_PROBE = ProbeSpec()
#: No probe: the policy's decisions unchanged.
NO_PROBE = ProbeSpec(enabled=False)


#: A stream's probe state (:attr:`ProbeTracker.due`): no probe, the acceptance probe
#: (rows left off speculate), the off probe (rows that speculate run off)...
NOT_PROBING, PROBE_ACCEPTANCE, PROBE_OFF = 0, 1, 2
#: ... and the cost probe (rows left off run ``cost_depth``).
PROBE_COST = 3
#: The start rule (``ProbeSpec.start_off``): every row that speculates runs off, and the
#: plugin does not hold the switch.
PROBE_START = 4
#: The start probe (``ProbeSpec.start_probe``): the acceptance probe, in the rows where
#: some depth would pay at ``start_accept`` per draft position (:func:`could_pay`).
PROBE_FIRST = 5
#: Batch buckets of the off probe's coverage: floor(log2(batch)), the last one open.
_BUCKETS = 16


def off_bucket(batch: int) -> int:
    """The off probe's batch bucket of ``batch`` requests."""
    return min(max(batch, 1).bit_length() - 1, _BUCKETS - 1)


def bucket_coverage(weights: list[float], stamps: list[int], now: int, batch: int,
                    forget: float) -> float:
    """Recent measurements near ``batch`` (the probes' coverage): its bucket's weight, and
    half of each neighbouring bucket's, forgotten by ``forget`` per decode step since its
    stamp (``now``: the decode step counter)."""
    bucket = off_bucket(batch)
    total = 0.0
    for k, share in ((bucket - 1, 0.5), (bucket, 1.0), (bucket + 1, 0.5)):
        if 0 <= k < _BUCKETS and weights[k]:
            total += share * weights[k] * forget ** (now - stamps[k])
    return total


def add_measurement(weights: list[float], stamps: list[int], bucket: int, now: int,
                    forget: float) -> None:
    """One measurement in ``bucket`` at decode step ``now``: its weight forgotten since its
    stamp, plus one."""
    weights[bucket] = 1.0 + weights[bucket] * forget ** (now - stamps[bucket])
    stamps[bucket] = now


class ProbeTracker:
    """One stream's probe budgets, folded record by record with its features."""

    __slots__ = (
        "budget_s",
        "cost_probe",
        "cost_s",
        "decode_steps",
        "off_budget_s",
        "off_confirmed",
        "off_cost_s",
        "off_expected",
        "off_remaining",
        "off_stamps",
        "off_weights",
        "remaining",
        "spec",
        "start_force",
        "start_last",
        "start_open",
        "start_probing",
        "start_wait",
    )

    def __init__(self, spec: ProbeSpec) -> None:
        self.spec = spec
        self.reset()

    def reset_start(self, unprofiled: bool = False) -> None:
        """The start rule's state of a new stream (``ProbeSpec.start_off``): open where the
        rule is on and the stream has no cost profile (``unprofiled``)."""
        #: The rule acts: no cost profile, and no speculative depth's cost measured yet.
        self.start_open = bool(self.spec.start_off) and unprofiled
        #: The depth of the latest decision (:meth:`decided`; -1: none yet).
        self.start_last = -1
        #: Decisions the rule turns off now: after a speculative step it let run, until
        #: a speculative sample arrives or ``start_off`` decisions have passed.
        self.start_force = False
        self.start_wait = 0

    def reset_acceptance(self, start: bool = True) -> None:
        """The acceptance probe's state of a new stream: no budget, and the start probe
        (``ProbeSpec.start_probe``) due if ``start`` (the stream has a cost profile and
        has measured no acceptance)."""
        self.budget_s = 0.0
        self.cost_s = 0.0  # the latest estimate of a probe's extra cost
        # decode records whose decisions still probe
        self.remaining = self.spec.start_probe if start else 0
        #: The decisions probing now are the start probe's (:data:`PROBE_FIRST`).
        self.start_probing = bool(self.remaining)

    def start_state_of(self, other: ProbeTracker) -> None:
        """Take the start rule's and the start probe's state of ``other`` (a copy)."""
        self.start_open, self.start_last = other.start_open, other.start_last
        self.start_force, self.start_wait = other.start_force, other.start_wait
        self.start_probing = other.start_probing

    def decided(self, steps: int) -> bool:
        """The decider's decision for the stream's batch size now (the depth it sends):
        the start rule counts the speculative steps its own decisions run (the telemetry
        shows them only a feedback lag later). A speculative decision after an off one is
        the plugin's re-entry warm-up, which measures nothing, so it is not counted; nor,
        with ``start_depth``, is one shallower than that. Returns whether the decision is
        unheld: every one while the rule is open at the default ``start_depth`` 0; with
        it, the off ones the rule forces and those at ``start_depth`` or deeper (the rest
        run as without the rule, held by the switch hold)."""
        if not self.start_open:
            return False
        depth = self.spec.start_depth
        unheld = not depth or steps >= depth
        if self.start_force:
            unheld = True
            self.start_wait += 1
            if self.start_wait >= self.spec.start_off:  # no sample came: another try
                self.start_force, self.start_wait = False, 0
        elif steps >= max(depth, 1) and self.start_last != 0:
            self.start_force, self.start_wait = True, 0
        self.start_last = steps
        return unheld

    def close_start_if_measured(self, features) -> None:
        """The start rule closes for the stream once it has a cost profile or a
        speculative depth's cost is measured (a sample never drops to 0 again)."""
        if features.cost_prior is not None or any(features.depth_samples()[1:]):
            self.start_open = self.start_force = False

    def reset(self, unprofiled: bool = False) -> None:
        """Forget the budget (a new stream; ``unprofiled``: it has no cost profile)."""
        self.reset_start(unprofiled)
        self.cost_probe = CostProbe(self.spec) if self.spec.cost_depth else None
        self.reset_acceptance(not unprofiled)
        # The off probe's (see the module): its budget, cost and due records; per batch
        # bucket the off measurements (weight at decode step ``off_stamps``: forgotten
        # lazily) and whether off's prediction there was confirmed; the bucket and the
        # predicted off latency (s) of the latest probe, until its first off step.
        self.off_budget_s = 0.0
        self.off_cost_s = 0.0
        self.off_remaining = 0
        self.off_weights = [0.0] * _BUCKETS
        self.off_stamps = [0] * _BUCKETS
        self.off_confirmed = [False] * _BUCKETS
        self.off_expected: tuple[int, float] | None = None
        self.decode_steps = 0

    def copy(self) -> ProbeTracker:
        """An independent copy (the daemon evaluates a copy of a stream's features)."""
        new = ProbeTracker(self.spec)
        new.budget_s, new.cost_s, new.remaining = self.budget_s, self.cost_s, self.remaining
        new.off_budget_s, new.off_cost_s = self.off_budget_s, self.off_cost_s
        new.off_remaining, new.off_expected = self.off_remaining, self.off_expected
        new.off_weights, new.off_stamps = list(self.off_weights), list(self.off_stamps)
        new.off_confirmed, new.decode_steps = list(self.off_confirmed), self.decode_steps
        new.cost_probe = None if self.cost_probe is None else self.cost_probe.copy()
        new.start_state_of(self)
        return new

    @property
    def due(self) -> int:
        """Which probe the decisions made now run (:data:`NOT_PROBING`,
        :data:`PROBE_ACCEPTANCE`, :data:`PROBE_OFF`, :data:`PROBE_COST` or the start
        rule's :data:`PROBE_START`, which comes first)."""
        if self.start_force:
            return PROBE_START
        return PROBE_OFF if self.off_remaining else self._due_unless_off()

    def _due_unless_off(self) -> int:
        """:attr:`due` when no off probe runs (shared with the compiled tracker)."""
        if self.remaining:
            return PROBE_FIRST if self.start_probing else PROBE_ACCEPTANCE
        cost = self.cost_probe
        return PROBE_COST if cost is not None and cost.remaining else NOT_PROBING

    def off_coverage(self, batch: int, forget: float) -> float:
        """Recent off measurements near ``batch``: its bucket's, and half of each
        neighbouring bucket's, forgotten by ``forget`` per decode step since."""
        return bucket_coverage(self.off_weights, self.off_stamps, self.decode_steps, batch,
                               forget)

    def fold(self, steps_used: int, latency_s: float, features, batch: int) -> None:
        """One decode record of ``batch`` requests at ``steps_used``, after ``features``
        (its :class:`env.features.FeatureBuilder`) folded it. Cheap unless the stream is
        off with stale acceptance: the daemon folds every record of every stream."""
        if self.spec.off_share:
            self._fold_off(steps_used, latency_s, features, batch)
        self.fold_acceptance(steps_used, latency_s, features, batch)

    def fold_acceptance(self, steps_used: int, latency_s: float, features, batch: int) -> None:
        """The acceptance probe's part of :meth:`fold` (and the cost probe's, which
        runs in Python in either backend, as the start rule's)."""
        if self.start_open:
            self.close_start_if_measured(features)
        if self.cost_probe is not None:
            self.cost_probe.fold(steps_used, latency_s, features, batch, busy=self.remaining)
        if self.remaining:
            self.remaining -= 1
            self.start_probing = self.start_probing and self.remaining > 0
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

    def _fold_off(self, steps_used: int, latency_s: float, features, batch: int) -> None:
        """The off probe's part of :meth:`fold` (see the module)."""
        self.decode_steps += 1
        if latency_s <= 0.0:
            return
        spec = self.spec
        bucket = off_bucket(batch)
        forget = features.spec.latency_forgetting
        if not steps_used:  # off measured at this batch
            add_measurement(self.off_weights, self.off_stamps, bucket, self.decode_steps,
                            forget)
            expected = self.off_expected
            if expected is not None and expected[0] == bucket:
                self.off_expected = None
                if abs(math.log(latency_s / expected[1])) <= spec.off_confirm:
                    self.off_confirmed[bucket] = True
            self.off_budget_s = 0.0
            if self.off_remaining:
                self.off_remaining -= 1
            return
        if self.off_remaining:
            self.off_remaining -= 1
            return
        if (self.off_confirmed[bucket] or self.off_coverage(batch, forget) >= spec.off_samples
                or (spec.off_trust and features.cost_prior is not None
                    and abs(features.profile_log_error) <= spec.off_trust)):
            self.off_budget_s = 0.0  # off's cost here is known or trusted: nothing to do
            return
        self.off_budget_s += spec.off_share_of(features.cost_prior is not None) * latency_s
        if self.off_budget_s < self.off_cost_s:
            return
        self.off_due(features, batch)

    def off_due(self, features, batch: int) -> None:
        """The end of :meth:`_fold_off` once the budget covers the latest estimate of an
        off probe's cost: estimate it again (the features' prediction of off at ``batch``,
        the time the probe spends off) and start the probe if the budget covers that."""
        predicted = float(features.latency_predictions_s(batch)[0])
        self.off_cost_s = self.spec.off_steps * max(predicted, 0.0)
        if self.off_budget_s >= self.off_cost_s and predicted > 0.0:
            self.off_budget_s = 0.0
            self.off_remaining = self.spec.off_steps
            self.off_expected = (off_bucket(batch), predicted)


class CostProbe:
    """One stream's cost probe (``ProbeSpec.cost_depth``; see the module): per batch
    bucket the recent steps run at ``cost_depth`` or deeper, and a budget earned off."""

    __slots__ = ("budget_s", "confirmed", "cost_s", "expected", "remaining", "spec", "stamps",
                 "steps", "weights")

    def __init__(self, spec: ProbeSpec) -> None:
        self.spec = spec
        self.budget_s = 0.0
        self.cost_s = 0.0  # the latest estimate of a probe's extra cost over off
        self.remaining = 0  # decode records whose decisions still probe
        self.steps = 0  # decode records folded (the weights' clock)
        self.weights = [0.0] * _BUCKETS
        self.stamps = [0] * _BUCKETS
        # Per bucket whether a probe's measured step confirmed the prediction it started
        # on (no further probe there), and that bucket and prediction (s) until measured.
        self.confirmed = [False] * _BUCKETS
        self.expected: tuple[int, float] | None = None

    def copy(self) -> CostProbe:
        """An independent copy."""
        new = CostProbe(self.spec)
        new.budget_s, new.cost_s, new.remaining = self.budget_s, self.cost_s, self.remaining
        new.steps, new.weights, new.stamps = self.steps, list(self.weights), list(self.stamps)
        new.confirmed, new.expected = list(self.confirmed), self.expected
        return new

    def fold(self, steps_used: int, latency_s: float, features, batch: int,
             busy: int = 0) -> None:
        """One decode record (after ``features`` folded it); ``busy``: the acceptance
        probe holds the decisions now (its steps speculate too, and are not this
        probe's). A stream with a cost profile does not probe (the profile prices every
        depth at every batch size and measurements correct it; the off probe covers a
        wrong one) unless ``cost_untrusted`` is set and the measurements sit further than
        that from the profile; without one the regression extrapolates a depth's cost from
        where it ran."""
        if features.cost_prior is not None and not (
                self.spec.cost_untrusted
                and abs(features.profile_log_error) > self.spec.cost_untrusted):
            return  # see above: nothing to keep either
        self.steps += 1
        if latency_s <= 0.0:
            return
        spec = self.spec
        forget = features.spec.latency_forgetting
        bucket = off_bucket(batch)
        if steps_used >= spec.cost_depth:  # the cost measured at this batch
            add_measurement(self.weights, self.stamps, bucket, self.steps, forget)
            self.budget_s = 0.0
            expected = self.expected
            if steps_used == spec.cost_depth and expected is not None and expected[0] == bucket:
                self.expected = None
                if abs(math.log(latency_s / expected[1])) <= spec.off_confirm:
                    self.confirmed[bucket] = True
        if self.remaining:
            self.remaining -= 1
            return
        if steps_used or busy:
            return  # only off time earns the budget
        if (self.confirmed[bucket] or bucket_coverage(self.weights, self.stamps, self.steps,
                                                      batch, forget) >= spec.cost_samples):
            self.budget_s = 0.0  # the cost is measured or confirmed here: nothing to do
            return
        self.budget_s += spec.cost_share * latency_s
        if self.budget_s < self.cost_s:
            return
        # The features' own prediction of the probe's steps over off, at this batch.
        predicted = features.latency_predictions_s(batch)
        depth = min(spec.cost_depth, len(predicted) - 1)
        depth_s, off_s = float(predicted[depth]), float(predicted[0])
        self.cost_s = spec.steps * max(depth_s - off_s, 0.0)
        if self.budget_s < self.cost_s or depth_s <= 0.0:
            return
        self.budget_s = 0.0
        if spec.cost_doubt:
            # Hopeless at even 1/cost_doubt of the price: the tokens a step at the depth
            # commits (the measured acceptance) do not cover it. The budget is spent anyway,
            # so this is asked again only once it is earned again.
            tokens = 1.0 + float(np.cumprod(features.accept_rates()[:depth]).sum())
            if tokens * off_s * spec.cost_doubt < depth_s:
                return
        self.remaining = spec.steps
        self.expected = (bucket, depth_s)


def probe_rows(index: np.ndarray, actions: np.ndarray, probe_index: int,
               where: np.ndarray | None = None) -> None:
    """In place: every entry of ``index`` (action indices) whose action is 0 becomes
    ``probe_index`` (only where ``where`` is true, if given)."""
    left_off = actions[index] == 0
    index[left_off if where is None else left_off & where] = probe_index


def could_pay(observations: np.ndarray, latency_columns: np.ndarray, actions: np.ndarray,
              accept: float) -> np.ndarray:
    """Per row of ``observations``, whether some speculative action would pay if every
    draft position were accepted with probability ``accept``: its predicted latency below
    the tokens a step would commit (``1 + accept + ... + accept ** depth``) times off's
    (the rows' ``relative_latency_d``, log(latency_d / latency_0) / 3 capped at 1, at the
    columns ``latency_columns[d]``)."""
    depths = actions[actions > 0]
    slower = 3.0 * observations[:, latency_columns[depths]]
    tokens = depths + 1.0 if accept == 1.0 else (1.0 - accept ** (depths + 1)) / (1.0 - accept)
    return (slower < np.log(tokens)).any(axis=1)


def off_probe_rows(index: np.ndarray, actions: np.ndarray, off_index: int) -> None:
    """In place: every entry of ``index`` (action indices) whose action speculates
    becomes ``off_index`` (the action 0's)."""
    index[actions[index] > 0] = off_index


def apply_probe(probe: ProbeSpec, index: np.ndarray, actions: np.ndarray,
                probing: Sequence[int], allowed: Sequence[np.ndarray | None],
                observations: np.ndarray | None = None,
                latency_columns: np.ndarray | None = None) -> None:
    """In place: the rows (shape (streams, grid rows)) of the streams ``probing`` says
    are due (:attr:`ProbeTracker.due`; True counts as the acceptance probe), probed
    (:func:`probe_rows`, or :func:`off_probe_rows` for the off probe where the server
    lets the stream run off); the one place both deciders and the simulator's policy
    adapter change a decision. The start probe (:data:`PROBE_FIRST`) reads the streams'
    ``observations`` (shape (streams x grid rows, size)) at ``latency_columns``
    (:attr:`env.guard.GuardColumns.latency`), which it needs."""
    for i, due in enumerate(probing):
        if due in (PROBE_OFF, PROBE_START):
            off = np.flatnonzero(actions == 0)
            if off.size and (allowed[i] is None or allowed[i][off[0]]):
                off_probe_rows(index[i], actions, int(off[0]))
        elif due:
            depth = probe.cost_depth if due == PROBE_COST else None
            target = probe.action_index(actions, allowed[i], depth)
            if target is None:
                continue
            hopeful = None
            if due == PROBE_FIRST:
                if observations is None or latency_columns is None:
                    raise ValueError("the start probe needs the observations and their "
                                     "latency columns")
                rows = index.shape[1]
                usable = actions if allowed[i] is None else np.where(allowed[i], actions, 0)
                hopeful = could_pay(observations[i * rows:(i + 1) * rows], latency_columns,
                                    usable, probe.start_accept)
            probe_rows(index[i], actions, target, hopeful)
