"""Telemetry records -> policy observation: the one place this happens.

The gymnasium environment feeds the :class:`~env.traces.schema.StepRecord` s that the
simulator emits; the controller daemon feeds the records an SGLang server sends
over the wire. Both fold records with :meth:`FeatureBuilder.update`; the environment
reads :meth:`FeatureBuilder.observation`, the controller :func:`observation_grids` for
all the streams pending in one poll at once. All three run the same code
(``_batch``), with elementwise arithmetic only across streams, so training and serving
build identical observations, bit for bit, from identical telemetry, whatever is
batched with what (``tests/test_feature_parity.py``, ``tests/test_features.py``).

The observation holds only what a server can know online:

* load: batch size, waiting requests, KV-cache use, the batch-size trend and the
  share of recent steps spent on prefill;
* acceptance: per draft position k, the conditional acceptance rate
  ``alpha_k = P(draft k accepted | drafts 1..k-1 accepted)``, estimated from
  exponentially decayed counts with a prior that falls back to position k-1
  (the first speculative step after an off period is left out: it drafts from a
  cold draft state)
  (chain drafting makes every depth's acceptance observable from per-request
  accepted counts: a request that accepted ``a`` drafts at depth ``d`` is a
  success at positions 1..a and, if ``a < d``, a failure at ``a + 1``);
* cost: step latency predicted for every depth at the current load: the
  server's cost profile when one is configured (fitted offline from the
  server's own recorded trace, see ``specctl-fit-profile``), plus a ridge
  regression of the observed residual on (batch size, speculation on, extra
  draft steps, KV tokens) with exponential forgetting (``FeatureSpec.latency_model``
  2 gives off its own level, batch slope and KV term, so a speculative run cannot move
  off's price; 3, the shipped policy's since the twelfth session, does so where a
  profile is handed). Without a profile the
  regression models the whole latency from a generic prior: then the cost of a
  depth the server has not run recently is a guess (chain telemetry cannot
  show the cost of a depth that is never used), which is why serving with a
  profile is recommended; optionally (``FeatureSpec.latency_local_samples``, the
  fourteenth session) a local measured-cost correction on top: a depth measured
  recently near the batch size is priced as measured there, whatever the regression
  over the profile says, and bounds the unmeasured depths around it; and
  (``FeatureSpec.drop_warmup_latency``, the seventeenth session) a depth-0 step that
  the next decode step follows speculating is left out of every cost estimate: on the
  plugin's off switch it is the re-entry warm-up (SGLang's own steps=0), not off
  (``FeatureSpec.warmup_flag``, the eighteenth session: read from the record's own
  ``warmup`` flag where it carries one, with no one-step lag);
* their combination: the estimated goodput of each depth relative to no
  speculation, ``(1 + E[accepted | d]) / latency(d)``;
* what is measured and what is assumed: per depth, a confidence that rises from
  0 to 1 within a few recent steps at that depth (exponentially forgotten, as the
  latency regression: a depth never run has a cost that is only the prior's
  guess), whether a cost profile was
  given, and how far the measured latencies sit from the profile's
  prediction (a wrong or swapped profile shows here within a few steps);
* control state: the steps of the latest step, steps since the last switch, and
  how stale the acceptance estimate is. (Not the policy's own last decision:
  online the controller sends a choice per batch size and learns which one the
  server applied only from telemetry, so training must not use it either.)
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

import numpy as np

from env.probe import ProbeSpec, ProbeTracker
from env.traces.schema import StepRecord

#: Bump when the meaning or order of the observation vector changes.
#: 2: per-depth cost confidence, cost-profile presence and error (after log_throughput).
#: 3: cost confidence is ``1 - exp(-samples / cost_confidence_samples)``: it tells an
#: unmeasured depth from one measured a few steps ago (log1p(samples) / log1p(1e4) put
#: both near 0, so a policy could not learn to measure a depth before trusting it).
FEATURE_VERSION = 3
#: FeatureSpec.latency_model's values: 1 the shared regression (an absent field: a policy
#: file written before the twelfth session computes as it did), 2 off's own level and slope,
#: 3 model 2 where a cost profile is handed and model 1 where none is (see effective_model).
LATENCY_MODELS = frozenset({1, 2, 3})


def _is_number(value: object) -> bool:
    """A real number, not a bool (a spec field read from a file may be anything)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def effective_model(latency_model: int, has_profile: bool) -> int:
    """The latency regression (1 or 2) a builder runs: model 3 is 2 with a profile (off's
    residual apart from speculation's) and 1 without (the old prior, which a policy trained
    on model 1 reads right)."""
    if latency_model == 3:
        return 2 if has_profile else 1
    return latency_model
#: The features' steps-since-acceptance count before any acceptance was measured (a
#: stream's first decode record counts from here): see FeatureBuilder.acceptance_age().
NEVER_MEASURED = 10**6
#: The accepted drafts of a step that measured none (see FeatureBuilder._warmup).
_NO_DRAFTS = np.zeros(0, dtype=np.int8)
_NO_DRAFTS.flags.writeable = False
#: The local cost correction's batch buckets (FeatureSpec.latency_local_samples): bucket j
#: holds batch sizes [2^j, 2^(j+1)), the last one everything above.
LOCAL_BUCKETS = 12
#: The weight of a neighbouring bucket's measurements (the profile carries them over the
#: factor of two in batch size).
LOCAL_NEIGHBOUR = 0.5


def local_bucket(batch_size: int) -> int:
    """The local cost correction's bucket of a batch size: floor(log2), within
    [0, LOCAL_BUCKETS - 1] (a loop of integer compares, as the compiled backend's)."""
    bucket = 0
    while bucket < LOCAL_BUCKETS - 1 and (2 << bucket) <= batch_size:
        bucket += 1
    return bucket


def local_tables(counts: np.ndarray, sums: np.ndarray, times: np.ndarray, clock: float,
                 forget: float, samples: float) -> tuple[np.ndarray, np.ndarray]:
    """The local cost correction per (depth, bucket), each shape (depth + 1,
    LOCAL_BUCKETS): its weight ``1 - exp(-n / samples)`` and the mean log(measured /
    profile) it moves toward, from the cells' counts and log-error sums as of their
    last update (``times``, on the decode-step ``clock``), decayed now, each bucket's
    neighbours added at LOCAL_NEIGHBOUR."""
    decay = forget ** (clock - times)
    counts, sums = counts * decay, sums * decay
    near_counts, near_sums = counts.copy(), sums.copy()
    near_counts[:, 1:] += LOCAL_NEIGHBOUR * counts[:, :-1]
    near_sums[:, 1:] += LOCAL_NEIGHBOUR * sums[:, :-1]
    near_counts[:, :-1] += LOCAL_NEIGHBOUR * counts[:, 1:]
    near_sums[:, :-1] += LOCAL_NEIGHBOUR * sums[:, 1:]
    measured = near_counts > 0.0
    ratio = np.zeros_like(near_sums)
    np.divide(near_sums, near_counts, out=ratio, where=measured)
    weight = -np.expm1(-near_counts / samples)
    return weight, ratio


@dataclass(frozen=True)
class FeatureSpec:
    """Everything that fixes the observation's layout and estimators.

    Exported policies carry their spec; the controller refuses a policy whose
    spec it cannot reproduce.
    """

    max_depth: int = 7
    version: int = FEATURE_VERSION
    #: Per speculative step decay of the acceptance counts (window ~ 1/(1-decay)).
    accept_decay: float = 0.97
    #: Prior strength (pseudo-requests) of each acceptance-rate estimate.
    accept_prior_strength: float = 4.0
    #: Prior acceptance rate of the first draft position.
    accept_prior_first: float = 0.7
    #: Per decode step forgetting factor of the latency regression.
    latency_forgetting: float = 0.995
    #: Ridge precision pulling the latency regression toward its prior.
    latency_ridge: float = 0.5
    #: Prior cost of switching speculation on (verify + draft extend), and of each
    #: further draft step, as fractions of the plain decode step.
    speculation_prior_fraction: float = 0.05
    draft_step_prior_fraction: float = 0.07
    #: The latency regression's form. 1: off and the speculative depths share the
    #: intercept, batch slope and KV term (speculating adds to them), so a long
    #: speculative run moves off's prediction with it; the policies of FEATURE_VERSION 3
    #: up to the twelfth session. 2 (see :data:`LATENCY_MODELS`): off has its own level,
    #: batch slope and KV term, and the speculative batch term is per verify token
    #: ((depth + 1) x batch), so speculative steps move off's prediction only through the
    #: prior; without a profile the prior ties the speculative terms to off's
    #: (scale-free), so a speculative measurement prices off by the verify tokens
    #: instead of at the flat fractions above. 3: 2 where a profile is handed, 1 where not.
    latency_model: int = 1
    #: latency_model 2, no profile: the prior's batch slope of off per 64 requests, as a
    #: fraction of off's level (each further verify token costs as much as one of off's).
    token_prior_fraction: float = 0.25
    #: latency_model 2, no profile: the weight (relative to the ties, 1) of the prior
    #: pulling off's level toward the observed latency level: small, so that the level
    #: (measured at whatever depth ran) only sets the scale when nothing else does.
    level_prior_weight: float = 0.01
    #: A decode step measured more than this many times the handed cost profile's
    #: prediction enters the latency estimators at this many times, while the stream's
    #: measurements agree with the profile (the mean log error within
    #: ``latency_outlier_trust``, after at least ``latency_outlier_warmup`` recent
    #: measured steps): a server's one-off stall (a 112-ms first use of a depth among
    #: 5-ms steps on a fresh H200, run 32) is not what a depth costs, and one such step
    #: left the policy off for 3.5 s where depth 3 pays. A profile far off (another
    #: server's) shows in the first steps' mean log error and is learned from whole
    #: steps, as without a profile. 0: off (the features before the thirteenth session).
    latency_outlier_ratio: float = 0.0
    latency_outlier_trust: float = 0.5
    latency_outlier_warmup: float = 10.0
    #: With ``latency_outlier_ratio``: before ``latency_outlier_warmup`` measured steps,
    #: clip a step too where it is over the ratio times the profile's price *and* over
    #: the ratio times what the stream's own earlier steps measured against the profile
    #: (the geometric mean of their measured / profile ratios, as they entered), the
    #: trust condition as after the warm-up; it enters at the ratio times the profile's
    #: price, as after the warm-up. Another server's profile makes every early step
    #: dear, so each is within the ratio of those before it and enters whole; a lone
    #: stall (an 83-210 ms step at a fresh stream's second measured step on the H200,
    #: runs 49, 51, 60) is clipped. A stream's first measured step has nothing to be
    #: judged against and enters whole. False: the features before the twentieth
    #: session (an absent field): every step before the warm-up enters whole.
    latency_outlier_relative: bool = False
    #: An off (depth-0) decode step measured more than this many times the handed
    #: profile's off price enters the latency estimators at this many times, under the
    #: outlier clip's conditions (the stream's mean log error within
    #: ``latency_outlier_trust``, after ``latency_outlier_warmup`` measured steps; applied
    #: after ``latency_outlier_ratio``'s clip): off's price is then never pulled above the
    #: profile's by more than the ratio, per step. The re-entry warm-up the plugin ends
    #: each off period with (SGLang's steps=0, 2.2-3x an off step on the H200 MoE at batch
    #: 32-48) counts as an off step in these features unless ``drop_warmup_latency``; where
    #: the off steps before it were left out (``latency_drop_before_prefill``), a short off
    #: period at a large batch leaves the warm-up off's only sample there: on run 73's
    #: "ppo r6" (the MoE at 6 requests/s) one 51.8-ms warm-up at batch 48 after two
    #: dropped 17-18 ms off steps priced off at 28-34 ms at batch 32-48 (measured 17) and
    #: the file ran depth 3 on 98% of the steps at batch >= 24 (docs/results/gpu22/
    #: LOCKIN.md). 0: off (the features before the twenty-second session; an absent
    #: field).
    latency_off_outlier_ratio: float = 0.0
    #: The local measured-cost correction (where a cost profile is handed; 0: off, the
    #: features before the fourteenth session): per depth and power-of-two batch bucket,
    #: the recent mean log(measured / profile-predicted latency) of that depth's steps
    #: there, forgotten as the regression forgets. A depth's prediction at a batch size
    #: moves toward the profile's there times that measured ratio, with weight ``1 -
    #: exp(-n / latency_local_samples)`` (n: its recent measurements in the batch size's
    #: bucket, its neighbours' at half weight). The shared regression over another
    #: server's profile mispredicts a depth measured a few steps ago by up to 5x (a
    #: per-depth error its residual terms cannot represent: docs/POLICY.md "cause 3");
    #: a depth unmeasured near this batch size keeps the regression's prediction.
    latency_local_samples: float = 0.0
    #: The local correction moves a prediction only by the part of its log distance to
    #: the measured target beyond this (0: all of it): a policy trained on the
    #: regression's predictions reads their small drifts as it learned to, while an
    #: error of several times (another server's profile) is corrected to within it.
    latency_local_tolerance: float = 0.0
    #: With the local correction, also price an unmeasured depth no higher than a deeper
    #: one measured nearby (blended out by its own weight). Off: the fourteenth session's
    #: candidate; on, it speculates more (report-only swapped-profile cells up to +0.04,
    #: never-pays windows -1 and -3 at seeds 1 and 3): docs/results/local_cost/.
    latency_local_cap: bool = False
    #: Leave out the latency of a depth-0 decode step that the next decode step follows
    #: speculating: on the plugin's off switch that step is the re-entry warm-up (SGLang's
    #: own steps=0, a verify forward and the draft extend, 1.3-2.9x an off step on the
    #: H200), not an off step. Counted as off, each short off period (the off probe's one
    #: step) priced off about 1.4x too slow on the H200 MoE (run 44). A depth-0 decode
    #: record, and the records after it, are folded when the next decode record arrives
    #: (the observation lags one step while off). False: the features before the
    #: seventeenth session (an absent field in a policy file).
    drop_warmup_latency: bool = False
    #: With ``drop_warmup_latency``: the warm-up is taken as the step where the server went
    #: back on, at the next step's depth, measuring nothing; so the speculative step after
    #: it is not a cold re-entry and its acceptance counts (the warm-up gave the draft a
    #: starting state). Without it, that step's acceptance is dropped as cold, and a
    #: two-step acceptance probe (warm-up, then one drafting step) measures nothing.
    warmup_restarts_draft: bool = False
    #: With ``drop_warmup_latency``: where a record carries its own warm-up flag
    #: (``StepRecord.warmup`` True or False: the plugin with its off path in use, the
    #: simulator on the off path, the eighteenth session on), read the warm-up from it
    #: instead of inferring it. A depth-0 decode record flagged a warm-up is folded at
    #: once without its latency, whatever follows it (a warm-up followed by off is still
    #: a warm-up, where the inference reads it as off); one flagged False is an off step,
    #: folded at once (no lag while off); with ``warmup_restarts_draft`` a speculative
    #: step right after a flagged warm-up is read as the inference reads it (the warm-up
    #: at that step's depth, the step warm). On a stream whose every warm-up is followed
    #: by speculation the features after each record the inference does not hold equal
    #: the inference's. A record without the flag (None: an older plugin or trace, or
    #: SGLang's own steps=0) is inferred as above. False: the inference for every record
    #: (the features before the eighteenth session; an absent field).
    warmup_flag: bool = False
    #: Leave out the latency of a decode step whose next record is a prefill. The plugin
    #: times a step from the previous step's result to its own; under SGLang's overlap
    #: scheduler the next batch is launched before a step's result is processed, and a
    #: prefill's launch is heavy CPU work, so the decode step before a prefill most
    #: likely carries it (the cost is measured, the mechanism inferred): on the H200
    #: dense model at acceptance 3.0 (runs 61-64), off steps 13.8 against 5.8 ms with no
    #: queue and 19.7 against 7.2 with one (depth 3: 19.6 against 10.5 and
    #: 32.2 against 32.1, where the long step hides most of it). Counted, they priced off
    #: 18-44% dear at batch >= 24, where off measured 1.1-1.5x depth 3's goodput, and
    #: the file shipped then speculated on 47-64% of those steps at 12 requests/s. A
    #: decode record that says so (``StepRecord.before_prefill``: the plugin knows it
    #: launched a prefill before processing the step's result) is folded without its
    #: latency at once; one that does not know (an older plugin or trace) is folded when
    #: the next record arrives (the observation lags one record), without its latency if
    #: that record is a prefill. False: the features before the twenty-first session (an
    #: absent field).
    latency_drop_before_prefill: bool = False
    #: Off's predicted latency at a batch size is at most ``exp(latency_off_ceiling)`` times
    #: the handed profile's off price there, while the stream trusts the profile (its
    #: measured steps' mean log error within ``latency_outlier_trust``): a ceiling on the
    #: regression's residual terms for off (level, batch slope, KV term), which a few off
    #: samples far above the profile extrapolate across batch sizes and KV use. On run 73's
    #: "ppo r6" (the MoE at 6 requests/s) three re-entry warm-ups (SGLang's steps=0 at the
    #: end of each short off period, 2.2-2.8x the profile's off price, counted as off steps)
    #: were 3 of off's 6 samples at batch >= 16 (the before-prefill drop took 5 of the 8
    #: real ones) and priced off at batch 32-48 at 22-33 ms, the profile 16.5-18.2 and the
    #: server 17.0: depth 3 ran on 98% of the steps at batch >= 24 (docs/results/gpu22/
    #: LOCKIN.md). Only a price above the profile's is bounded: one below it (off at
    #: batch 1-23 on that server, 0.3-0.9x the profile) stays as measured. 0: off (the
    #: features before the twenty-second session; an absent field).
    latency_off_ceiling: float = 0.0
    #: With ``latency_off_ceiling``: the ceiling bounds off's price only at batch sizes
    #: >= this (0: at every batch size). Where off runs often (the MoE at batch 8-23, off on
    #: 30-60% of the steps), each off period's re-entry warm-up counted as an off sample
    #: books the warm-up's excess once per off period, spread over its off steps: about
    #: off's effective price with its switch cost, which the ceiling there took away
    #: (off +0.15-0.17 at MoE batch 8-23 open loop, where depth 3 measured 1.05-1.19x).
    #: Where off is rare (batch >= 24 on run 73 "ppo r6"), a few warm-ups set the
    #: regression's off terms and the bound is needed. 0: the ceiling at every batch size
    #: (the features before the twenty-third session; an absent field).
    latency_off_ceiling_batch: float = 0.0
    #: With ``latency_off_ceiling``: the ceiling at a batch size rises to what off's own
    #: steps measured near it, as they accumulate: to the profile's off price times their
    #: mean measured / profile ratio (per power-of-two batch bucket, the neighbouring
    #: buckets at half weight, forgotten as the regression forgets; a re-entry warm-up
    #: flagged on its record, ``StepRecord.warmup``, is not one of off's steps), with
    #: weight ``1 - exp(-n / latency_off_ceiling_samples)`` (n: those steps' recent count
    #: there). The ceiling waits for the stream to trust the profile, and that trust is
    #: the mean error of every measured step, mostly speculative ones: a profile that
    #: prices off too low but speculation right is trusted, and the bare ceiling then
    #: pinned off near the profile's price even where off had been measured dearer many
    #: times (the simulator's wrong-profile cells, to 0.65x the file without the ceiling:
    #: docs/results/gpu23/ceil_cells.md). Off measured near or below the profile (run
    #: 73's real off steps: 17 ms at batch >= 24, the profile 16.5-18.4) leaves the
    #: ceiling where it is, however often. 0: the ceiling never rises (the features
    #: before the twenty-fourth session; an absent field).
    latency_off_ceiling_samples: float = 0.0
    #: Recent cost measurements of a depth at which its confidence is 1 - 1/e.
    cost_confidence_samples: float = 2.0
    #: EMA weight for the load and throughput trackers.
    ema_alpha: float = 0.1
    #: Normalisers (log1p scales) of the load features.
    batch_scale: float = 1024.0
    waiting_scale: float = 4096.0
    switch_scale: float = 1000.0
    #: Batch sizes a decision is computed for. The observation's batch features
    #: use the largest grid value <= the batch size, so the controller can send
    #: one decision per grid value and the server picks by its actual batch size.
    batch_grid: tuple[int, ...] = (
        1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
    )

    def __post_init__(self) -> None:
        if type(self.latency_model) is not int or self.latency_model not in LATENCY_MODELS:
            raise ValueError(f"feature spec field 'latency_model': {self.latency_model!r} is "
                             f"not one of {sorted(LATENCY_MODELS)}")
        for name in ("latency_outlier_ratio", "latency_off_outlier_ratio"):
            ratio = getattr(self, name)
            if not _is_number(ratio) or not (ratio == 0.0 or 1.0 < ratio < math.inf):
                raise ValueError(f"feature spec field {name!r}: {ratio!r} is not 0 "
                                 "(off) or a number above 1")
        for name in ("latency_outlier_trust", "latency_outlier_warmup"):
            value = getattr(self, name)
            if not _is_number(value) or not 0.0 < value < math.inf:
                raise ValueError(f"feature spec field {name!r}: {value!r} is not a positive "
                                 "number")
        for name in ("latency_local_cap", "drop_warmup_latency", "warmup_restarts_draft",
                     "warmup_flag", "latency_outlier_relative",
                     "latency_drop_before_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"feature spec field {name!r}: "
                                 f"{getattr(self, name)!r} is not true or false")
        for name in ("latency_local_samples", "latency_local_tolerance",
                     "latency_off_ceiling", "latency_off_ceiling_batch",
                     "latency_off_ceiling_samples"):
            value = getattr(self, name)
            if not _is_number(value) or not 0.0 <= value < math.inf:
                raise ValueError(f"feature spec field {name!r}: {value!r} is not 0 or a "
                                 "positive number")

    def to_dict(self) -> dict:
        """JSON-friendly copy, stored in exported policies."""
        data = asdict(self)
        data["batch_grid"] = list(self.batch_grid)
        return data

    def grid_floor(self, batch_size: int) -> int:
        """The largest grid batch size <= ``batch_size`` (the smallest if none)."""
        index = bisect.bisect_right(self.batch_grid, batch_size) - 1
        return self.batch_grid[max(index, 0)]

    @classmethod
    def from_dict(cls, data: dict) -> FeatureSpec:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown feature-spec fields: {sorted(unknown)}")
        data = dict(data)
        if "batch_grid" in data:
            data["batch_grid"] = tuple(int(b) for b in data["batch_grid"])
        spec = cls(**data)
        if spec.version != FEATURE_VERSION:
            raise ValueError(
                f"feature spec version {spec.version} is not supported "
                f"(this build understands version {FEATURE_VERSION})"
            )
        return spec

    def names(self) -> list[str]:
        """Names of the observation vector's entries, in order."""
        depths = range(1, self.max_depth + 1)
        return [
            "log_batch_size",
            "log_waiting_requests",
            "kv_use",
            "batch_trend",
            "prefill_share",
            "steps_used",
            "log_steps_since_switch",
            "log_steps_since_acceptance",
            *[f"accept_rate_{k}" for k in depths],
            *[f"accept_confidence_{k}" for k in depths],
            "log_latency_ms",
            *[f"relative_latency_{d}" for d in depths],
            *[f"relative_goodput_{d}" for d in depths],
            "log_throughput",
            *[f"cost_confidence_{d}" for d in range(self.max_depth + 1)],
            "has_cost_profile",
            "cost_profile_error",
        ]

    @property
    def size(self) -> int:
        """Length of the observation vector."""
        return 13 + 5 * self.max_depth


@dataclass(frozen=True)
class Observation:
    """An observation, both as named quantities (for rule-based policies) and as
    the flat vector a neural policy sees.

    Arrays indexed by depth have ``max_depth + 1`` entries (depth 0 first);
    ``accept_rate`` has ``max_depth`` entries (position 1 first).
    """

    vector: np.ndarray
    batch_size: int
    waiting_requests: int
    kv_use: float
    steps_used: int
    steps_since_switch: int
    accept_rate: np.ndarray
    expected_accepted: np.ndarray
    latency_pred_s: np.ndarray
    kv_used_tokens: int
    #: Decode steps recently measured at each depth 0..max_depth (forgotten as the
    #: latency regression forgets); near 0 = that depth's cost is the prior's guess.
    cost_samples: np.ndarray = field(default_factory=lambda: np.zeros(0))
    #: Recent mean of log(measured / profile-predicted latency) of the depths run (0
    #: without a profile): the vector's ``cost_profile_error`` before its clip to [-1, 1].
    cost_profile_error: float = 0.0
    #: Records fed since the previous observation, oldest first.
    new_records: tuple[StepRecord, ...] = field(default=())
    #: Which probe decisions made on this observation run (the builder's
    #: :class:`env.probe.ProbeTracker`'s ``due``: 0 none, 1 acceptance, 2 off, 3 cost; 0
    #: without one; 4: the start rule's off).
    probing: int = 0
    #: Whether the decision made on this observation must not be held by the plugin's
    #: switch hold (the start rule, ``ProbeSpec.start_off``; the builder's ``unheld``).
    unheld: bool = False


class FeatureBuilder:
    """Folds a stream of step records into the current observation.

    Feed records in step order with :meth:`update`; read the observation with
    :meth:`observation` (or :meth:`observation_grid` for every grid batch size).
    """

    #: Which implementation this is: "numpy" here, "compiled" for
    #: :class:`env.features_compiled.CompiledFeatureBuilder`.
    backend = "numpy"
    #: What keeps a probe's budgets (the compiled backend folds the off probe compiled).
    tracker_type: type[ProbeTracker] = ProbeTracker

    def __new__(cls, spec: FeatureSpec | None = None, cost_prior=None,
                backend: str | None = None, probe: ProbeSpec | None = None) -> FeatureBuilder:
        if cls is FeatureBuilder and resolve_backend(backend) == "compiled":
            from env.features_compiled import CompiledFeatureBuilder

            cls = CompiledFeatureBuilder
        return super().__new__(cls)

    def __init__(self, spec: FeatureSpec | None = None, cost_prior=None,
                 backend: str | None = None, probe: ProbeSpec | None = None) -> None:
        """
        Args:
            spec: the observation layout and estimator settings.
            cost_prior: optional cost profile of the server (anything with
                ``step_latency_s`` and ``step_latency_array``, e.g.
                :class:`env.sim.cost_model.CostProfile`): the latency model's prior mean.
            backend: "compiled" (numba), "numpy", or None for :func:`resolve_backend`'s
                default. Both compute the same observations (to float rounding).
            probe: the acceptance probe whose budget these features keep (see
                :mod:`env.probe`; None or disabled: none).
        """
        self.spec = spec or FeatureSpec()
        self._per_sample = 1.0 / self.spec.cost_confidence_samples
        self.cost_prior = cost_prior
        #: The latency regression this builder runs (effective_model: per spec and profile).
        self._model = effective_model(self.spec.latency_model, cost_prior is not None)
        #: Whether the local measured-cost correction runs (it needs a profile to carry a
        #: measured ratio across a bucket's batch sizes).
        self._local_on = self.spec.latency_local_samples > 0.0 and cost_prior is not None
        #: Whether off's own measurements per batch bucket are kept for the off ceiling
        #: (FeatureSpec.latency_off_ceiling_samples; a ceiling needs a profile).
        self._off_cells_on = (self.spec.latency_off_ceiling > 0.0 and cost_prior is not None
                              and self.spec.latency_off_ceiling_samples > 0.0)
        self._layout = _layout(self.spec)
        # Depth first, shape (depth + 1, 1, 1): see _latency_predictions(). These and the
        # design cache depend on the spec and the profile only: kept across resets.
        depths = np.arange(self.spec.max_depth + 1, dtype=float).reshape(-1, 1, 1)
        self._depths = depths.astype(int)
        self._design_cache: dict[tuple, tuple] = {}
        self._speculating = (depths > 0).astype(float)
        self._extra_drafts = np.maximum(depths - 1.0, 0.0)
        self.probe_tracker: ProbeTracker | None = None
        self.reset()
        self.set_probe(probe)

    def set_probe(self, probe: ProbeSpec | None) -> None:
        """Keep the budget of ``probe`` from now on (None or disabled: none): from 0 if it
        differs from the one kept so far."""
        if probe is None or not probe.enabled:
            self.probe_tracker = None
        elif self.probe_tracker is None or self.probe_tracker.spec != probe:
            self.probe_tracker = self.tracker_type(probe)
            if self.cost_prior is None:  # the start rule: open unless a cost is measured
                self.probe_tracker.reset_start(True)
                self.probe_tracker.close_start_if_measured(self)
            # the start probe: with a profile, while no acceptance is measured
            self.probe_tracker.reset_acceptance(self.cost_prior is not None
                                                and not self.acceptance_age()[1])

    @property
    def probing(self) -> int:
        """Which probe decisions made on the features as they are now run
        (:attr:`env.probe.ProbeTracker.due`; 0, false: none)."""
        tracker = self.probe_tracker
        return 0 if tracker is None else tracker.due

    @property
    def unheld(self) -> bool:
        """Whether the decision made on the features as they are now may be unheld by the
        plugin's switch hold (the start rule, ``ProbeSpec.start_off``, is open: so that
        what it decides runs, and it can count the speculative steps its decisions run);
        :meth:`decided` says whether it is (``ProbeSpec.start_depth``)."""
        tracker = self.probe_tracker
        return tracker is not None and tracker.start_open

    def decided(self, steps: int) -> bool:
        """The decider's decision for the latest batch size (its steps): the start rule
        counts the speculative steps its decisions run (:meth:`env.probe.ProbeTracker.
        decided`). Returns whether that decision is unheld (false where the rule is not
        open: call it where :attr:`unheld` is true)."""
        tracker = self.probe_tracker
        return tracker is not None and tracker.decided(steps)

    def depth_samples(self) -> list[float]:
        """Decode steps recently measured at each depth 0..max_depth (as ``cost_samples``)."""
        return list(self._depth_samples)

    def reset(self) -> None:
        """Forget all telemetry."""
        depth = self.spec.max_depth
        # Acceptance counts as plain floats: per record, Python arithmetic on 7 values
        # costs less than numpy's per-call overhead.
        self._trials = [0.0] * depth
        self._successes = [0.0] * depth
        # Latency regression on x = [1, b, s, s*b, m, m*b, kv] with b = batch/64,
        # s = 1 if speculating, m = draft forwards beyond the first (depth - 1),
        # kv = tokens/1e5: the cost model's structure (verify + extend switch on
        # with speculation; each further depth adds a draft forward). latency_model 2:
        # x = [o, o*b, s, s*v, m, o*kv, s*kv] with o = 1 - s and v = (depth + 1) * b, the
        # verify tokens (see _regressor_row). Its sufficient
        # statistics X'X and X'y live in one 8 x 8 matrix (see update()); the records'
        # regressors are folded into it when it is next read (_fold_moments), batched
        # across the streams of a poll.
        self._moments = np.zeros((8, 8))
        self._pending: list[list[float]] = []
        self._theta: np.ndarray | None = None
        self._latency_ms_ema: float | None = None
        self._depth_samples = [0.0] * (self.spec.max_depth + 1)
        self._prior_log_error = 0.0
        # spec.latency_outlier_relative: the summed log(entered / profile) of the measured
        # steps so far, and their number.
        self._early_log_error = 0.0
        self._early_steps = 0.0
        # The local cost correction's cells (depth * LOCAL_BUCKETS + bucket): forgotten
        # count and log-error sum as of the cell's last update, that update's time on the
        # decode-step clock (decayed when read: see local_tables).
        cells = (self.spec.max_depth + 1) * LOCAL_BUCKETS
        self._local_counts = [0.0] * cells
        self._local_sums = [0.0] * cells
        self._local_times = [0.0] * cells
        self._local_clock = 0.0
        # The off ceiling's cells (FeatureSpec.latency_off_ceiling_samples): off's own
        # steps per batch bucket, warm-ups left out, kept as the local cells are (on the
        # same clock).
        self._off_counts = [0.0] * LOCAL_BUCKETS
        self._off_sums = [0.0] * LOCAL_BUCKETS
        self._off_times = [0.0] * LOCAL_BUCKETS
        self._batch_size = 0
        self._batch_ema: float | None = None
        self._batch_trend = 0.0
        self._prefill_share = 0.0
        self._throughput_ema: float | None = None
        self._waiting = 0
        self._kv_use = 0.0
        self._kv_used_tokens = 0
        self._steps_used = 0
        self._steps_since_switch = 0
        self._steps_since_acceptance = NEVER_MEASURED
        self._new_records: list[StepRecord] = []
        self._held: list[StepRecord] = []
        #: spec.latency_drop_before_prefill: the latest decode record, not yet folded.
        self._before_prefill: StepRecord | None = None
        #: After a flagged warm-up (``spec.warmup_flag`` and ``warmup_restarts_draft``):
        #: the steps used and steps since the switch before it (see _restart_at).
        self._restart: tuple[int, int] | None = None
        if self.probe_tracker is not None:
            self.probe_tracker.reset(self.cost_prior is None)

    def copy(self) -> FeatureBuilder:
        """An independent copy of the estimators as they are now (sharing the spec, the
        cost profile and the caches): the daemon evaluates a stream's earlier records in
        the same batch as its latest one."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._new_records = []
        new._held = list(self._held)
        new._copy_estimators()
        if new.probe_tracker is not None:
            new.probe_tracker = new.probe_tracker.copy()
        return new

    def _copy_estimators(self) -> None:
        """Replace the estimators' mutable containers (shared after copy()) with copies."""
        self._trials = list(self._trials)
        self._successes = list(self._successes)
        self._depth_samples = list(self._depth_samples)
        self._local_counts = list(self._local_counts)
        self._local_sums = list(self._local_sums)
        self._local_times = list(self._local_times)
        self._off_counts = list(self._off_counts)
        self._off_sums = list(self._off_sums)
        self._off_times = list(self._off_times)
        self._moments = self._moments.copy()
        self._pending = list(self._pending)  # the regressor rows themselves never change

    # -- input ---------------------------------------------------------------

    def update_many(self, records: Iterable[StepRecord]) -> None:
        """Feed several records in order."""
        for record in records:
            self.update(record)

    def update(self, record: StepRecord) -> None:
        """Fold one step record into the estimators (with ``spec.drop_warmup_latency``, a
        depth-0 decode record not flagged either way and those after it once the next
        decode record is known; with ``spec.latency_drop_before_prefill``, a decode
        record whose ``before_prefill`` is unknown once the next record is known)."""
        self._new_records.append(record)
        if self.spec.latency_drop_before_prefill:
            earlier = self._before_prefill
            if earlier is not None:  # held: was the next record a prefill?
                self._before_prefill = None
                if record.prefill_tokens > 0 and earlier.step_latency_s > 0.0:
                    # it carried this prefill's launch (the spec): its cost is not a step's
                    earlier = replace(earlier, step_latency_s=0.0)
                self._update(earlier)
            if record.prefill_tokens == 0:
                flag = record.before_prefill
                if flag is None:  # unknown (an older plugin or trace): hold it a record
                    self._before_prefill = record
                    return
                if flag and record.step_latency_s > 0.0:  # known: no need to wait
                    record = replace(record, step_latency_s=0.0)
        self._update(record)

    def _update(self, record: StepRecord) -> None:
        """:meth:`update` after ``spec.latency_drop_before_prefill``'s hold."""
        spec = self.spec
        if not spec.drop_warmup_latency:
            self._fold_record(record)
            return
        held = self._held
        decode = record.prefill_tokens == 0
        if held:
            if not decode:
                held.append(record)
                return
            if record.steps_used > 0:  # the held depth-0 step was the re-entry warm-up
                held[0] = self._warmup(held[0], record.steps_used)
            for earlier in held:
                self._fold_record(earlier)
            held.clear()
        if decode:
            restart = self._restart
            if restart is not None:  # the decode step after a flagged warm-up
                self._restart = None
                if record.steps_used > 0:
                    self._restart_at(record.steps_used, *restart)
            if record.steps_used <= 0:
                flag = record.warmup if spec.warmup_flag else None
                if flag is None:  # unknown: infer it from the next decode record
                    if record.step_latency_s > 0.0:
                        held.append(record)
                        return
                elif flag:  # the re-entry warm-up, by the record's own word
                    if spec.warmup_restarts_draft:
                        self._restart = (self._steps_used, self._steps_since_switch)
                    self._fold_record(replace(record, step_latency_s=0.0))
                    return
        self._fold_record(record)

    def _restart_at(self, steps: int, used: int, since: int) -> None:
        """The flagged warm-up just folded (at depth 0, with ``steps_used`` ``used`` and
        ``since`` steps since the switch before it) read as the inference folds a warm-up
        (``_warmup``): at ``steps``, the depth of the step after it, so that this step
        drafts warm (no cold re-entry) and the switch counts at the warm-up."""
        steps = min(max(steps, 0), self.spec.max_depth)
        self._set_switch(steps, 0 if steps != used else since + 1)

    def _set_switch(self, steps_used: int, since_switch: int) -> None:
        """Set the latest step's depth and the steps since the last switch."""
        self._steps_used = steps_used
        self._steps_since_switch = since_switch

    def _warmup(self, record: StepRecord, next_steps: int) -> StepRecord:
        """The re-entry warm-up ``record`` as folded: without its latency, and (with
        ``spec.warmup_restarts_draft``) at the depth that followed, with no acceptance."""
        if not self.spec.warmup_restarts_draft:
            return replace(record, step_latency_s=0.0)
        return replace(record, step_latency_s=0.0, steps_used=next_steps,
                       accepted_drafts=_NO_DRAFTS)

    def _fold_record(self, record: StepRecord) -> None:
        """Fold one step record into the estimators, now."""
        spec = self.spec
        self._waiting = record.waiting_requests
        self._kv_use = record.kv_use
        self._kv_used_tokens = record.kv_used_tokens
        alpha = spec.ema_alpha
        is_prefill = 0.0 if record.is_decode else 1.0
        self._prefill_share += alpha * (is_prefill - self._prefill_share)
        if not record.is_decode:
            return

        batch = max(record.batch_size, 1)
        if self._batch_ema is None:
            self._batch_ema = float(batch)
        trend = (batch - self._batch_ema) / max(self._batch_ema, 1.0)
        self._batch_trend += alpha * (trend - self._batch_trend)
        self._batch_ema += alpha * (batch - self._batch_ema)
        self._batch_size = batch

        steps = min(max(record.steps_used, 0), spec.max_depth)
        # The first speculative step after speculation was off drafts from a cold draft
        # state: its acceptance says how re-entry goes, not how this traffic accepts.
        reentry = steps > 0 and self._steps_used == 0
        if steps != self._steps_used:
            self._steps_since_switch = 0
        else:
            self._steps_since_switch += 1
        self._steps_used = steps

        accepted = record.accepted_drafts
        # counts[a] = requests that accepted a drafts: the acceptance estimate's input and
        # (as sum a * counts[a]) the step's output; plain ints from here on.
        counts = np.bincount(accepted).tolist() if len(accepted) else []

        latency_s = record.step_latency_s
        if latency_s > 0.0:
            latency_ms = latency_s * 1e3
            residual_ms = latency_ms
            if self.cost_prior is not None:
                prior_ms = 1e3 * self.cost_prior.step_latency_s(
                    batch, steps, record.kv_used_tokens, 0, **_latency_flags(steps))
                ratio = spec.latency_outlier_ratio
                if (ratio > 0.0 and latency_ms > ratio * prior_ms
                        and abs(self._prior_log_error) < spec.latency_outlier_trust):
                    if sum(self._depth_samples) >= spec.latency_outlier_warmup:
                        latency_ms = residual_ms = ratio * prior_ms  # an outlier: see the spec
                    elif (spec.latency_outlier_relative and self._early_steps > 0.0
                          and latency_ms > ratio * prior_ms * math.exp(
                              self._early_log_error / self._early_steps)):
                        # over the ratio x the stream's own earlier steps too (the spec)
                        latency_ms = residual_ms = ratio * prior_ms
                off_ratio = spec.latency_off_outlier_ratio
                if (off_ratio > 0.0 and steps == 0 and latency_ms > off_ratio * prior_ms
                        and abs(self._prior_log_error) < spec.latency_outlier_trust
                        and sum(self._depth_samples) >= spec.latency_outlier_warmup):
                    latency_ms = residual_ms = off_ratio * prior_ms  # see the spec
                residual_ms -= prior_ms
                error = math.log(latency_ms / max(prior_ms, 1e-6))
                self._prior_log_error += alpha * (error - self._prior_log_error)
                if spec.latency_outlier_relative:
                    self._early_log_error += error
                    self._early_steps += 1.0
            forget = spec.latency_forgetting
            samples = self._depth_samples
            for d in range(len(samples)):  # plain floats: 8 numpy calls cost more
                samples[d] *= forget
            samples[steps] += 1.0
            if self._local_on or self._off_cells_on:
                self._local_clock += 1.0
            if self._local_on:  # the profile's error of this depth at this batch size
                cell = steps * LOCAL_BUCKETS + local_bucket(batch)
                decay = forget ** (self._local_clock - self._local_times[cell])
                self._local_counts[cell] = self._local_counts[cell] * decay + 1.0
                self._local_sums[cell] = self._local_sums[cell] * decay + error
                self._local_times[cell] = self._local_clock
            if self._off_cells_on and steps == 0 and record.warmup is not True:
                cell = local_bucket(batch)  # off's own error here (latency_off_ceiling_samples)
                decay = forget ** (self._local_clock - self._off_times[cell])
                self._off_counts[cell] = self._off_counts[cell] * decay + 1.0
                self._off_sums[cell] = self._off_sums[cell] * decay + error
                self._off_times[cell] = self._local_clock
            # The regression's sufficient statistics in one matrix, [x, y] [x, y]^T with
            # y the residual: X'X is its top-left 7 x 7 block, X'y its last column.
            # Folded (moments * forget + z z^T, record by record) when next read.
            self._pending.append(_regressor_row(self._model, batch, steps,
                                                record.kv_used_tokens, residual_ms))
            self._theta = None
            if self._latency_ms_ema is None:
                self._latency_ms_ema = latency_ms
            else:
                self._latency_ms_ema += alpha * (latency_ms - self._latency_ms_ema)
            # record.output_tokens, without a numpy call
            output = record.batch_size + sum(map(operator.mul, range(len(counts)), counts))
            rate = output / latency_s
            if self._throughput_ema is None:
                self._throughput_ema = rate
            else:
                self._throughput_ema += alpha * (rate - self._throughput_ema)

        if steps > 0 and counts and not reentry:
            # A request that accepted a >= steps drafts (a > steps only from a server
            # running deeper than max_depth) succeeded at every position 1..steps.
            decay, trials, successes = spec.accept_decay, self._trials, self._successes
            reached = len(accepted)  # requests that accepted >= k drafts, k = 0 first
            for k in range(len(trials)):
                trials[k] *= decay
                successes[k] *= decay
                if k < steps:
                    trials[k] += reached
                    reached -= counts[k] if k < len(counts) else 0
                    successes[k] += reached
            self._steps_since_acceptance = 0
        else:
            self._steps_since_acceptance += 1
        if self.probe_tracker is not None:
            self.probe_tracker.fold(steps, latency_s, self, batch)

    # -- output --------------------------------------------------------------

    def acceptance_age(self) -> tuple[int, bool]:
        """``(age, measured)``: decode steps since acceptance was last measured, or, if it
        never was (``measured`` False), since the first decode record (the acceptance
        probe's input, :mod:`env.probe`)."""
        if self._trials[0] > 0.0:
            return self._steps_since_acceptance, True
        return self._steps_since_acceptance - NEVER_MEASURED, False

    @property
    def profile_log_error(self) -> float:
        """Recent mean log(measured / profile-predicted latency) of the decode steps run
        (0 without a profile): the observation's ``cost_profile_error`` before its clip."""
        return self._prior_log_error

    def accept_rates(self) -> np.ndarray:
        """Conditional acceptance rate per draft position (1..max_depth)."""
        return _batch([self], np.array(self.spec.batch_grid[:1])).rates[0].copy()

    def latency_predictions_s(self, batch_sizes: np.ndarray | int) -> np.ndarray:
        """Predicted step latency (s) of every depth 0..max_depth at each batch size.

        Returns shape ``(len(batch_sizes), max_depth + 1)`` (or ``(max_depth + 1,)``
        for a scalar), at the latest KV use.
        """
        scalar = np.ndim(batch_sizes) == 0
        predicted = _batch([self], np.atleast_1d(batch_sizes)).latency_s[:, 0].T
        return predicted[0] if scalar else predicted

    def _design(self, batch_sizes: np.ndarray):
        """Per set of batch sizes (cached): the latency regression's design for every
        depth and batch size (depth first), shape ((depth + 1) * n, 6), and the cost
        profile's latency (ms) at KV 0 and its slope per KV token (the profile's KV
        term is linear), each of shape (depth + 1, 1, n), or None without a profile.

        Building these per decision was most of the controller's time.
        """
        key = tuple(batch_sizes.tolist())
        cached = self._design_cache.get(key)
        if cached is None:
            batches, depths = np.broadcast_arrays(np.maximum(batch_sizes, 1)[None, :],
                                                  self._depths[:, :, 0])
            b = (batches / 64.0).ravel()
            s = self._speculating[:, :, 0] + 0.0 * batches
            m = self._extra_drafts[:, :, 0] + 0.0 * batches
            s, m = s.ravel(), m.ravel()
            if self._model == 1:
                design = np.stack([np.ones_like(b), b, s, s * b, m, m * b], axis=-1)
            else:  # as _regressor_row's model 2; its KV terms: _latency_predictions()
                o, v = 1.0 - s, (depths.ravel() + 1) * b
                design = np.stack([o, o * b, s, s * v, m, 0.0 * b], axis=-1)
            prior = None
            if self.cost_prior is not None:
                flat_b, flat_d = batches.ravel(), depths.ravel()
                flags = {"draft_extend": flat_d > 0, "speculative_path": flat_d > 0}
                at0 = 1e3 * self.cost_prior.step_latency_array(flat_b, flat_d, 0, 0, **flags)
                at1 = 1e3 * self.cost_prior.step_latency_array(flat_b, flat_d, 100_000, 0,
                                                               **flags)
                shape = (depths.shape[0], 1, depths.shape[1])
                prior = (at0.reshape(shape), ((at1 - at0) / 100_000).reshape(shape))
            cached = self._design_cache[key] = (design, prior)
        return cached

    def observation(self, batch_size: int | None = None) -> Observation:
        """The observation after all records fed so far.

        Args:
            batch_size: size of the batch the decision is for, when known (the
                server knows it when it asks); defaults to the latest decode
                step's. The vector uses its grid floor (see ``batch_grid``).
        """
        if batch_size is None:
            batch_size = self._batch_size
        quantised = self.spec.grid_floor(batch_size)
        # Row 0 (the grid floor) is computed exactly as observation_grids() computes it.
        batch = _batch([self], np.array([quantised, batch_size]))
        new_records = tuple(self._new_records)
        self._new_records.clear()
        return Observation(
            vector=batch.vectors[0, 0],
            batch_size=int(batch_size),
            waiting_requests=self._waiting,
            kv_use=self._kv_use,
            steps_used=self._steps_used,
            steps_since_switch=self._steps_since_switch,
            accept_rate=batch.rates[0],
            expected_accepted=batch.expected[0],
            latency_pred_s=batch.latency_s[:, 0, 1],
            kv_used_tokens=self._kv_used_tokens,
            cost_samples=np.array(self._depth_samples),
            cost_profile_error=self._prior_log_error,
            new_records=new_records,
            probing=self.probing,
            unheld=self.unheld,
        )

    def observation_grid(self) -> np.ndarray:
        """Observation vectors for every ``batch_grid`` batch size, shape (grid, size).

        Row i equals ``observation(batch_grid[i]).vector``; the controller
        evaluates the policy on all rows and sends one decision per grid value.
        """
        return observation_grids([self])[0]

    def _state_row(self) -> list[float]:
        """This builder's row of :func:`_batch`'s state: the vector's batch-independent
        entries before their scaling (see :class:`_Layout`), then the KV tokens, the
        latency level (ms) and the expected accepted drafts per depth."""
        rates, expected = _acceptance(self._trials, self._successes, self.spec)
        return [
            self._waiting, self._kv_use, self._batch_trend, self._prefill_share,
            self._steps_used, self._steps_since_switch, self._steps_since_acceptance,
            *rates, *self._trials, self._latency_ms_ema or 0.0,
            self._throughput_ema or 0.0,
            *[-math.expm1(-samples * self._per_sample) for samples in self._depth_samples],
            1.0 if self.cost_prior is not None else 0.0, self._prior_log_error,
            self._kv_used_tokens,
            10.0 if self._latency_ms_ema is None else self._latency_ms_ema, *expected,
        ]


def _regressor_row(model: int, batch_size: int, steps: int, kv_tokens: int,
                   residual_ms: float) -> list[float]:
    """One decode step's row [x, y] of the latency regression (see FeatureBuilder.reset):
    model 1 x = [1, b, s, s*b, m, m*b, kv]; model 2 x = [o, o*b, s, s*v, m, o*kv, s*kv],
    off's terms apart from speculation's, whose batch term counts verify tokens (its span
    holds model 1's m*b: s*v = 2*s*b + m*b)."""
    b = batch_size / 64.0
    s = 1.0 if steps > 0 else 0.0
    m = float(max(steps - 1, 0))
    if model == 1:
        return [1.0, b, s, s * b, m, m * b, kv_tokens / 1e5, residual_ms]
    o, kv = 1.0 - s, kv_tokens / 1e5
    return [o, o * b, s, s * ((steps + 1) * b), m, o * kv, s * kv, residual_ms]


def observation_grids(builders: Sequence[FeatureBuilder]) -> np.ndarray:
    """Every builder's :meth:`~FeatureBuilder.observation_grid` in one go, shape
    ``(len(builders), grid, size)``: a few whole-array numpy calls for all of them
    (the controller's decisions for all streams pending in one poll), each row equal
    bit for bit to the one computed alone (elementwise arithmetic only).

    The builders must share the feature spec and the cost profile (the same object,
    or None). Raises ``numpy.linalg.LinAlgError`` if any stream's regression is
    singular (evaluate the streams one by one to find which).
    """
    for builder in builders:
        builder._new_records.clear()
    # No builders: _batch's clear error, not an IndexError from builders[0] here.
    grid = builders[0]._layout.grid if builders else np.asarray(())
    return _batch(builders, grid)[0]


class _Batch(NamedTuple):
    """What :func:`_batch` computes: vectors (builders, batch sizes, size) float32,
    latency predictions (s) (depth + 1, builders, batch sizes), the acceptance rates
    (builders, depth) and the expected accepted drafts (builders, depth + 1)."""

    vectors: np.ndarray
    latency_s: np.ndarray
    rates: np.ndarray
    expected: np.ndarray


class _Layout:
    """How a builder's state row (see :meth:`FeatureBuilder._state_row`) becomes the
    vector's batch-independent entries: ``log1p`` on some columns, then ``* mul / div``
    (each column has one of them 1.0, which is exact), so the whole step is four numpy
    calls however many streams there are."""

    def __init__(self, spec: FeatureSpec) -> None:
        depth = spec.max_depth
        log_switch = math.log1p(spec.switch_scale)
        confidence = 1.0 / math.log1p(1e4)
        # (log1p?, mul, div) per entry, in vector order from column 1.
        entries = [
            (True, 1.0, math.log1p(spec.waiting_scale)),  # waiting requests
            (False, 1.0, 1.0),  # kv use
            (False, 10.0, 1.0),  # batch trend (the box clip bounds it)
            (False, 1.0, 1.0),  # prefill share
            (False, 1.0, float(depth)),  # steps used
            (True, 1.0 / log_switch, 1.0),  # steps since switch
            (True, 1.0 / log_switch, 1.0),  # steps since acceptance
            *[(False, 1.0, 1.0)] * depth,  # acceptance rates
            *[(True, confidence, 1.0)] * depth,  # acceptance confidence (trials)
            (True, 1.0, math.log1p(1000.0)),  # latency (ms)
            # ... the per-depth relative latency and goodput go here ...
            (True, 1.0, math.log1p(1e6)),  # throughput
            *[(False, 1.0, 1.0)] * (depth + 1),  # cost confidence (1 - exp(-samples/k))
            (False, 1.0, 1.0),  # has cost profile
            (False, 1.0, 1.0),  # cost profile error
        ]
        self.head = 8 + 2 * depth  # entries before the per-depth latency and goodput
        self.width = len(entries)
        self.logs = np.array([log for log, _, _ in entries])
        self.mul = np.array([mul for _, mul, _ in entries])
        self.div = np.array([div for _, _, div in entries])
        # The latency regression's ridge, and its prior without a cost profile as
        # fractions of the observed latency level (see _latency_predictions()).
        self.ridge = spec.latency_ridge
        self.ridge_eye = spec.latency_ridge * np.eye(7)
        self.prior_fractions = np.array([1.0, 0.0, spec.speculation_prior_fraction, 0.0,
                                         spec.draft_step_prior_fraction, 0.0, 0.0])
        # latency_model 2 without a profile: the prior's precision (X'X's addend) and its
        # right-hand side per unit of level, (ridge Q'WQ, ridge W Q'c) of the penalties
        # W (Q theta - c level)^2 (see _prior_ties); with a profile (the residual's prior 0)
        # and in model 1: ridge_eye.
        ties, weights = _prior_ties(spec)
        self.prior_matrix = spec.latency_ridge * (ties.T * weights) @ ties
        self.prior_rhs = spec.latency_ridge * spec.level_prior_weight * ties[0]
        #: The spec's batch grid as an array: one object, so a builder can know it by
        #: identity (env.features_compiled caches its inputs so). Read only.
        self.grid = np.asarray(spec.batch_grid)
        self.grid.flags.writeable = False


def _batch(builders: Sequence[FeatureBuilder], batch_sizes: np.ndarray) -> _Batch:
    """Observations of ``builders`` at ``batch_sizes``: a fixed number of whole-array
    numpy calls for all of them (at these sizes each call's ~1 us overhead is the cost,
    so the calls are shared), elementwise only, so a row does not depend on what else
    is in the batch."""
    if not builders:
        raise ValueError("no feature builders given")
    first = builders[0]
    spec, cost_prior = first.spec, first.cost_prior
    kind = type(first)
    for builder in builders:
        if (builder.spec is not spec and builder.spec != spec) or (
                builder.cost_prior is not cost_prior) or type(builder) is not kind:
            raise ValueError("feature builders batched together must share the feature "
                             "spec and the cost profile (and the backend)")
    if first.backend != "numpy":
        return first._batch(builders, batch_sizes)
    layout = first._layout
    depth = spec.max_depth
    flat: list[float] = []
    for builder in builders:  # one flat list converts faster than nested ones
        flat += builder._state_row()
    state = np.array(flat).reshape(len(builders), -1)
    width = layout.width
    entries = state[:, :width]
    np.log1p(entries, out=entries, where=layout.logs)
    entries = entries * layout.mul / layout.div
    kv_tokens, base_ms = state[:, width], state[:, width + 1]
    rates = state[:, 7:7 + depth]  # after the 7 load and control entries of _state_row
    expected = state[:, width + 2:]
    latency = _latency_predictions(builders, batch_sizes, kv_tokens, base_ms)
    # log(latency_d / latency_0), and log goodput ratios from it (depth first)
    log_latency = np.log(latency)
    slower = log_latency[1:] - log_latency[:1]
    log_tokens = np.log1p(expected).T[:, :, None]
    gain = log_tokens[1:] - log_tokens[:1]
    out = np.empty((len(builders), len(batch_sizes), spec.size), dtype=np.float32)
    out[:, :, 0] = np.log1p(batch_sizes) / math.log1p(spec.batch_scale)
    head = 1 + layout.head
    out[:, :, 1:head] = entries[:, None, :layout.head]
    # np.minimum/np.maximum, not np.clip: the ufuncs cost a third of clip's overhead.
    out[:, :, head:head + depth] = (np.minimum(slower, 3.0) / 3.0).transpose(1, 2, 0)
    out[:, :, head + depth:head + 2 * depth] = (
        np.maximum(np.minimum(gain - slower, 3.0), -3.0) / 3.0).transpose(1, 2, 0)
    out[:, :, head + 2 * depth:] = entries[:, None, layout.head:]
    # Extreme loads (e.g. thousands waiting) saturate rather than leave the box.
    np.minimum(out, 1.0, out=out)
    np.maximum(out, -1.0, out=out)
    return _Batch(out, latency, rates, expected)


def _acceptance(trials: Sequence[float], successes: Sequence[float],
                spec: FeatureSpec) -> tuple[list[float], list[float]]:
    """Acceptance rate per draft position 1..max_depth from the decayed counts, and the
    expected accepted drafts per depth 0..max_depth (plain floats: 7 values)."""
    # Each position's prior is the estimate of the position before it.
    prior = spec.accept_prior_first
    strength = spec.accept_prior_strength
    rates, expected, reach, total = [], [0.0], 1.0, 0.0
    for trial, success in zip(trials, successes, strict=True):
        prior = (success + strength * prior) / (trial + strength)
        rates.append(prior)
        reach *= prior
        total += reach
        expected.append(total)
    return rates, expected


def _latency_predictions(builders: Sequence[FeatureBuilder], batch_sizes: np.ndarray,
                         kv_tokens: np.ndarray, base_ms: np.ndarray) -> np.ndarray:
    """Predicted step latency (s), shape (depth + 1, builders, batch sizes), given each
    builder's KV tokens and latency level (ms) (the prior's scale and the floor's)."""
    first = builders[0]
    layout = first._layout
    stale = [i for i, b in enumerate(builders) if b._theta is None]
    if stale:  # one batched 7 x 7 solve for every stream that saw telemetry
        moments = _fold_moments([builders[i] for i in stale])
        rhs = moments[:, :7, 7]
        precision = layout.ridge_eye
        if first.cost_prior is None:  # else: the residual over the profile, none expected
            level = base_ms if len(stale) == len(builders) else base_ms[stale]
            if first._model == 1:
                # The observed level at depth 0, fixed fractions of it for speculating.
                rhs = rhs + (level[:, None] * layout.prior_fractions) * layout.ridge
            else:  # speculation's terms tied to off's (see _prior_ties)
                rhs = rhs + level[:, None] * layout.prior_rhs
                precision = layout.prior_matrix
        thetas = np.linalg.solve(moments[:, :7, :7] + precision, rhs[:, :, None])[..., 0]
        for i, theta in zip(stale, thetas, strict=True):
            builders[i]._theta = theta
        if len(stale) < len(builders):
            thetas = _stack([b._theta for b in builders])
    else:
        thetas = _stack([b._theta for b in builders])
    # The regression x = [1, b, s, s*b, m, m*b, kv] (model 2: see reset()): one matrix-vector
    # product per stream, never one product for all of them (its rounding could then
    # depend on how many streams are stacked: batching must be invisible), depth first.
    # A stacked matmul makes exactly those products, one per stream, in one call (bit for
    # bit the per-stream `design @ theta[:6]` it replaced, without its Python loop).
    design, prior = first._design(batch_sizes)
    n, rows = len(builders), len(batch_sizes)
    depths = design.shape[0] // rows
    if n == 1:  # the same product, without the stacking's few extra calls
        predicted = (design @ thetas[0, :6]).reshape(depths, 1, rows)
    else:
        predicted = np.matmul(design, thetas[:, :6, None]).reshape(n, depths, rows)
        predicted = predicted.transpose(1, 0, 2)
    kv = kv_tokens[:, None]
    if first._model == 1:
        predicted += thetas[:, 6:7] * (kv / 1e5)
    else:  # off's KV term at depth 0, speculation's at the others
        predicted[:1] += thetas[:, 5:6] * (kv / 1e5)
        predicted[1:] += thetas[:, 6:7] * (kv / 1e5)
    if prior is not None:
        at0, slope = prior
        profile_ms = at0 + slope * kv
        predicted += profile_ms
    # Physically a deeper draft never costs less; keep the prediction sane.
    floor = np.maximum(0.05 * base_ms, 1e-3)[:, None]
    floored = np.maximum(predicted, floor)
    ceiling = first.spec.latency_off_ceiling
    if ceiling > 0.0 and prior is not None:  # FeatureSpec.latency_off_ceiling
        trusted = np.array([abs(b._prior_log_error) < first.spec.latency_outlier_trust
                            for b in builders])[:, None]
        cap = profile_ms[0] * math.exp(ceiling)
        if first._off_cells_on:  # FeatureSpec.latency_off_ceiling_samples
            cap = cap * _off_ceiling_lift(builders, batch_sizes)
        # FeatureSpec.latency_off_ceiling_batch: below it the warm-ups' excess stays in
        above = np.maximum(batch_sizes, 1) >= first.spec.latency_off_ceiling_batch
        bounded = trusted & above[None, :]
        floored[0] = np.where(bounded, np.minimum(floored[0], cap), floored[0])
    if first._local_on:
        weights = _correct_locally(builders, batch_sizes, floored, profile_ms)
        # A depth measured here is priced as measured, not raised to an unmeasured
        # shallower depth's guess (the running maximum, blended out by the depth's
        # weight: an unmeasured depth still never costs less than a shallower one);
        # then (latency_local_cap), the same way, an unmeasured depth never costs more
        # than a deeper one measured here (the running minimum from the deepest down).
        running = floored[0]
        for depth in range(1, len(floored)):
            value = floored[depth]
            up = np.maximum(value, running)
            running = floored[depth] = up * np.exp(
                weights[depth] * (np.log(value) - np.log(up)))
        for depth in range(len(floored) - 2 if first.spec.latency_local_cap else -1, -1, -1):
            value = floored[depth]
            down = np.minimum(value, floored[depth + 1])
            floored[depth] = down * np.exp(weights[depth] * (np.log(value) - np.log(down)))
        return floored * 1e-3
    return np.maximum.accumulate(floored, axis=0) * 1e-3


def _off_ceiling_lift(builders: Sequence[FeatureBuilder], batch_sizes: np.ndarray
                      ) -> np.ndarray:
    """The factor each builder's off ceiling rises by at each batch size (shape (builders,
    batch sizes), >= 1): toward off's own mean measured / profile ratio near it (its cells
    read as :func:`local_tables` reads the local correction's), beyond the ceiling, by
    that measurement's weight (FeatureSpec.latency_off_ceiling_samples)."""
    spec = builders[0].spec
    buckets = [local_bucket(int(b)) for b in batch_sizes.tolist()]
    lift = np.empty((len(builders), len(buckets)))
    for i, builder in enumerate(builders):
        weight, ratio = local_tables(
            np.array(builder._off_counts)[None], np.array(builder._off_sums)[None],
            np.array(builder._off_times)[None], builder._local_clock,
            spec.latency_forgetting, spec.latency_off_ceiling_samples)
        beyond = np.maximum(ratio[0, buckets] - spec.latency_off_ceiling, 0.0)
        lift[i] = np.exp(weight[0, buckets] * beyond)
    return lift


def _correct_locally(builders: Sequence[FeatureBuilder], batch_sizes: np.ndarray,
                     predicted: np.ndarray, profile_ms: np.ndarray) -> np.ndarray:
    """In place: each builder's predictions (ms, shape (depth + 1, builders, batch
    sizes)) moved toward the profile's (``profile_ms``, the same shape) times the
    measured ratio of their depth and batch bucket, in log space, by the local weight
    (FeatureSpec.latency_local_samples; weight 0 leaves a prediction as it was).
    Returns the weights (the predictions' shape)."""
    spec = builders[0].spec
    shape = (spec.max_depth + 1, LOCAL_BUCKETS)
    buckets = [local_bucket(int(b)) for b in batch_sizes.tolist()]
    weights = np.empty_like(predicted)
    for i, builder in enumerate(builders):
        weight, ratio = local_tables(
            np.array(builder._local_counts).reshape(shape),
            np.array(builder._local_sums).reshape(shape),
            np.array(builder._local_times).reshape(shape), builder._local_clock,
            spec.latency_forgetting, spec.latency_local_samples)
        value = predicted[:, i, :]
        gap = np.log(profile_ms[:, i, :]) + ratio[:, buckets] - np.log(value)
        beyond = np.maximum(np.abs(gap) - spec.latency_local_tolerance, 0.0)
        weights[:, i, :] = weight[:, buckets]
        predicted[:, i, :] = value * np.exp(weights[:, i, :] * np.copysign(beyond, gap))
    return weights


def _fold_moments(builders: Sequence[FeatureBuilder]) -> np.ndarray:
    """The builders' moments stacked, shape (builders, 8, 8), with the regressors their
    records left pending folded in (each builder keeps a view of its row).

    Record by record, exactly as folding each on arrival (``moments * forget + z z^T``,
    elementwise: a stream's values do not depend on what else is stacked), but in rounds
    over all streams at once (the j-th pending record of every stream that has one):
    three numpy calls per round instead of four per record and stream.
    """
    if len(builders) == 1:  # one stream (local mode, the gym env): fold in place
        builder = builders[0]
        moments, forget = builder._moments, builder.spec.latency_forgetting
        for regressors in builder._pending:
            z = np.array(regressors)
            moments *= forget
            moments += z[:, None] * z
        builder._pending.clear()
        return moments[None]
    moments = _stack([b._moments for b in builders])  # a copy
    counts = [len(b._pending) for b in builders]
    most = max(counts)
    if not most:
        return moments
    forget = builders[0].spec.latency_forgetting
    for j in range(most):
        if counts[-1] > j and min(counts) > j:  # every stream (the common case)
            z = np.array([b._pending[j] for b in builders])
            moments *= forget
            moments += z[:, :, None] * z[:, None, :]
        else:
            rows = [i for i, count in enumerate(counts) if count > j]
            z = np.array([builders[i]._pending[j] for i in rows])
            part = moments[rows] * forget
            part += z[:, :, None] * z[:, None, :]
            moments[rows] = part
    for i, builder in enumerate(builders):
        if counts[i]:
            builder._pending.clear()
            builder._moments = moments[i]
    return moments


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    """``np.stack(arrays)``; a view for one array (the single stream's common case)."""
    return arrays[0][None] if len(arrays) == 1 else np.stack(arrays)


def warm_up(spec: FeatureSpec | None = None, cost_prior=None, backend: str | None = None) -> None:
    """Run the backend's code once on made-up telemetry: the compiled backend compiles
    (or loads from numba's cache) now, at start-up, not at the first decision (seconds
    when compiling, ~0.5 s loading). A daemon and a local decider call this first."""
    builders = [FeatureBuilder(spec, cost_prior, backend) for _ in range(2)]
    probed = FeatureBuilder(spec, cost_prior, backend, probe=ProbeSpec(off_share=1.0))
    drafts = np.zeros(1, dtype=np.int8)
    # Both kinds of int8 drafts the builders are fed: decoded (read only) and simulated;
    # and a fold with the off probe (the compiled backend folds both in one call).
    for accepted in (drafts, np.frombuffer(drafts.tobytes(), dtype=np.int8)):
        for builder in (builders[0], probed):
            builder.update(StepRecord("warm-up", 0, 1, 0.0, 1, 0, 1, 0, 1, 0, 1, accepted,
                                      0.01))
    observation_grids(builders)
    builders[0].observation()


#: Environment variable choosing the default backend: "compiled" or "numpy".
BACKEND_VARIABLE = "SPECCTL_FEATURES"


@functools.cache
def compiled_available() -> bool:
    """Whether the compiled backend can run here (numba imports)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str | None = None) -> str:
    """The backend a :class:`FeatureBuilder` uses: ``backend`` if given, else the
    ``SPECCTL_FEATURES`` environment variable, else "compiled" where numba is installed
    and "numpy" where not. Raises ValueError for an unknown name, or "compiled" without
    numba."""
    chosen = backend or os.environ.get(BACKEND_VARIABLE) or ""
    if chosen == "":
        return "compiled" if compiled_available() else "numpy"
    if chosen not in ("compiled", "numpy"):
        source = "backend" if backend else f"environment variable {BACKEND_VARIABLE}"
        raise ValueError(f"{source}: unknown feature backend {chosen!r} "
                         "(expected 'compiled' or 'numpy')")
    if chosen == "compiled" and not compiled_available():
        raise ValueError("feature backend 'compiled' needs numba, which is not installed "
                         "(pip install numba, or choose 'numpy')")
    return chosen


def _prior_ties(spec: FeatureSpec) -> tuple[np.ndarray, np.ndarray]:
    """latency_model 2's prior without a profile, as rows Q and weights W of the penalties
    ``W (Q theta - c level)^2`` on theta = [o, o*b, s, s*v, m, o*kv, s*kv] (c: 1 in the
    first row, else 0): off's level at the observed one (weakly: it sets the scale only
    when nothing measured does), its slope per 64 requests ``token_prior_fraction`` of its
    level, speculating's level off's plus ``speculation_prior_fraction``, its slope per
    64 verify tokens off's per 64 tokens, each further draft step
    ``draft_step_prior_fraction`` of off's level, off's KV term 0 (model 1's prior) and
    speculating's off's. Every row but the first and the sixth ties speculation's terms
    to off's: scale-free, so a measured depth prices off (and the other depths) by its
    verify tokens, and a measured off prices the depths."""
    ties = np.eye(7)
    ties[1, 0] = -spec.token_prior_fraction
    ties[2, 0] = -(1.0 + spec.speculation_prior_fraction)
    ties[3, 1] = -1.0
    ties[4, 0] = -spec.draft_step_prior_fraction
    ties[6, 5] = -1.0
    weights = np.ones(7)
    weights[0] = spec.level_prior_weight
    return ties, weights


@functools.lru_cache(maxsize=16)
def _layout(spec: FeatureSpec) -> _Layout:
    return _Layout(spec)


def _latency_flags(steps: int) -> dict[str, bool]:
    """How a step of ``steps`` runs when the controller drives the server: steps 0 is
    the plugin's real off switch (no speculative path, no draft extend)."""
    on = steps > 0
    return {"draft_extend": on, "speculative_path": on}
