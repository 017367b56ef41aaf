"""Telemetry records -> policy observation: the one place this happens.

The gymnasium environment feeds the :class:`~env.schema.StepRecord` s that the
simulator emits; the controller daemon feeds the records an SGLang server sends
over the wire. Both call :meth:`FeatureBuilder.update` and
:meth:`FeatureBuilder.observation`, so training and serving build identical
observations from identical telemetry.

The observation holds only what a server can know online:

* load: batch size, waiting requests, KV-cache use, the batch-size trend and the
  share of recent steps spent on prefill;
* acceptance: per draft position k, the conditional acceptance rate
  ``alpha_k = P(draft k accepted | drafts 1..k-1 accepted)``, estimated from
  exponentially decayed counts with a prior that falls back to position k-1
  (chain drafting makes every depth's acceptance observable from per-request
  accepted counts: a request that accepted ``a`` drafts at depth ``d`` is a
  success at positions 1..a and, if ``a < d``, a failure at ``a + 1``);
* cost: step latency predicted for every depth at the current load, from a ridge
  regression of observed latency on (batch size, depth, KV tokens) with
  exponential forgetting, fitted to the telemetry itself;
* their combination: the estimated goodput of each depth relative to no
  speculation, ``(1 + E[accepted | d]) / latency(d)``;
* control state: the steps of the latest step, the last decision, steps since
  the last switch, and how stale the acceptance estimate is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from env.schema import StepRecord

#: Bump when the meaning or order of the observation vector changes.
FEATURE_VERSION = 1


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
    latency_forgetting: float = 0.99
    #: Ridge precision pulling the latency regression toward its prior.
    latency_ridge: float = 0.5
    #: Prior cost of one draft step, as a fraction of the plain decode step.
    draft_step_prior_fraction: float = 0.07
    #: EMA weight for the load and throughput trackers.
    ema_alpha: float = 0.1
    #: Normalisers (log1p scales) of the load features.
    batch_scale: float = 1024.0
    waiting_scale: float = 4096.0
    switch_scale: float = 1000.0

    def to_dict(self) -> dict:
        """JSON-friendly copy, stored in exported policies."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> FeatureSpec:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown feature-spec fields: {sorted(unknown)}")
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
            "last_decision",
            "log_steps_since_switch",
            "log_steps_since_acceptance",
            *[f"accept_rate_{k}" for k in depths],
            *[f"accept_confidence_{k}" for k in depths],
            "log_latency_ms",
            *[f"relative_latency_{d}" for d in depths],
            *[f"relative_goodput_{d}" for d in depths],
            "log_throughput",
        ]

    @property
    def size(self) -> int:
        """Length of the observation vector."""
        return 11 + 4 * self.max_depth


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
    last_decision: int
    steps_since_switch: int
    accept_rate: np.ndarray
    expected_accepted: np.ndarray
    latency_pred_s: np.ndarray
    kv_used_tokens: int
    #: Records fed since the previous observation, oldest first.
    new_records: tuple[StepRecord, ...] = field(default=())


class FeatureBuilder:
    """Folds a stream of step records into the current observation.

    Feed records in step order with :meth:`update`; tell it each decision with
    :meth:`note_decision`; read the observation with :meth:`observation`.
    """

    def __init__(self, spec: FeatureSpec | None = None) -> None:
        self.spec = spec or FeatureSpec()
        self.reset()

    def reset(self) -> None:
        """Forget all telemetry."""
        depth = self.spec.max_depth
        self._trials = np.zeros(depth)
        self._successes = np.zeros(depth)
        # Latency regression on x = [1, b, d, d*b, kv] (b = batch/64, kv = tokens/1e5).
        self._xtx = np.zeros((5, 5))
        self._xty = np.zeros(5)
        self._latency_ms_ema: float | None = None
        self._batch_size = 0
        self._batch_ema: float | None = None
        self._batch_trend = 0.0
        self._prefill_share = 0.0
        self._throughput_ema: float | None = None
        self._waiting = 0
        self._kv_use = 0.0
        self._kv_used_tokens = 0
        self._steps_used = 0
        self._last_decision = 0
        self._steps_since_switch = 0
        self._steps_since_acceptance = 10**6
        self._new_records: list[StepRecord] = []

    # -- input ---------------------------------------------------------------

    def note_decision(self, steps: int) -> None:
        """Record the steps the policy just chose (known to the decider)."""
        self._last_decision = int(steps)

    def update_many(self, records: Iterable[StepRecord]) -> None:
        """Feed several records in order."""
        for record in records:
            self.update(record)

    def update(self, record: StepRecord) -> None:
        """Fold one step record into the estimators."""
        spec = self.spec
        self._new_records.append(record)
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
        if steps != self._steps_used:
            self._steps_since_switch = 0
        else:
            self._steps_since_switch += 1
        self._steps_used = steps

        latency_s = record.step_latency_s
        if latency_s > 0.0:
            latency_ms = latency_s * 1e3
            x = self._regressors(batch, steps, record.kv_used_tokens)
            forget = spec.latency_forgetting
            self._xtx *= forget
            self._xty *= forget
            self._xtx += np.outer(x, x)
            self._xty += x * latency_ms
            if self._latency_ms_ema is None:
                self._latency_ms_ema = latency_ms
            else:
                self._latency_ms_ema += alpha * (latency_ms - self._latency_ms_ema)
            rate = record.output_tokens / latency_s
            if self._throughput_ema is None:
                self._throughput_ema = rate
            else:
                self._throughput_ema += alpha * (rate - self._throughput_ema)

        accepted = record.accepted_drafts
        if steps > 0 and accepted.size:
            counts = np.bincount(np.minimum(accepted, steps), minlength=steps + 1)
            # at_least[k] = requests that accepted >= k drafts, k = 0..steps
            at_least = np.cumsum(counts[::-1])[::-1]
            self._trials *= spec.accept_decay
            self._successes *= spec.accept_decay
            self._trials[:steps] += at_least[:-1]
            self._successes[:steps] += at_least[1:]
            self._steps_since_acceptance = 0
        else:
            self._steps_since_acceptance += 1

    # -- output --------------------------------------------------------------

    def accept_rates(self) -> np.ndarray:
        """Conditional acceptance rate per draft position (1..max_depth)."""
        spec = self.spec
        rates = np.empty(spec.max_depth)
        prior = spec.accept_prior_first
        strength = spec.accept_prior_strength
        for k in range(spec.max_depth):
            prior = (self._successes[k] + strength * prior) / (self._trials[k] + strength)
            rates[k] = prior
        return rates

    def latency_predictions_s(self, batch_size: int, kv_tokens: int) -> np.ndarray:
        """Predicted step latency (s) of every depth 0..max_depth at this load."""
        spec = self.spec
        base_ms = self._latency_ms_ema if self._latency_ms_ema is not None else 10.0
        # Prior: the observed level for depth 0, a fixed fraction of it per draft step.
        prior = np.array([base_ms, 0.0, spec.draft_step_prior_fraction * base_ms, 0.0, 0.0])
        ridge = spec.latency_ridge * np.eye(5)
        theta = np.linalg.solve(self._xtx + ridge, self._xty + ridge @ prior)
        depths = np.arange(spec.max_depth + 1)
        b = max(batch_size, 1) / 64.0
        kv = kv_tokens / 1e5
        design = np.stack(
            [np.ones_like(depths, float), np.full(depths.shape, b), depths, depths * b,
             np.full(depths.shape, kv)],
            axis=1,
        )
        predicted = design @ theta
        # Physically a deeper draft never costs less; keep the prediction sane.
        floor = max(0.05 * base_ms, 1e-3)
        predicted = np.maximum.accumulate(np.maximum(predicted, floor))
        return predicted / 1e3

    def observation(self) -> Observation:
        """The observation after all records fed so far."""
        spec = self.spec
        depth = spec.max_depth
        rates = self.accept_rates()
        expected = np.concatenate([[0.0], np.cumsum(np.cumprod(rates))])
        latency = self.latency_predictions_s(self._batch_size, self._kv_used_tokens)
        goodput = (1.0 + expected) / latency
        relative_goodput = np.clip(np.log(goodput[1:] / goodput[0]), -3.0, 3.0) / 3.0
        relative_latency = np.clip(np.log(latency[1:] / latency[0]), 0.0, 3.0) / 3.0
        confidence = np.log1p(self._trials) / math.log1p(1e4)
        latency_ms = self._latency_ms_ema or 0.0
        throughput = self._throughput_ema or 0.0
        head = [
            math.log1p(self._batch_size) / math.log1p(spec.batch_scale),
            math.log1p(self._waiting) / math.log1p(spec.waiting_scale),
            self._kv_use,
            max(-1.0, min(1.0, self._batch_trend * 10.0)),
            self._prefill_share,
            self._steps_used / depth,
            self._last_decision / depth,
            math.log1p(self._steps_since_switch) / math.log1p(spec.switch_scale),
            min(1.0, math.log1p(self._steps_since_acceptance) / math.log1p(spec.switch_scale)),
        ]
        vector = np.concatenate(
            [
                head,
                rates,
                np.minimum(confidence, 1.0),
                [math.log1p(latency_ms) / math.log1p(1000.0)],
                relative_latency,
                relative_goodput,
                [math.log1p(throughput) / math.log1p(1e6)],
            ]
        ).astype(np.float32)
        new_records = tuple(self._new_records)
        self._new_records.clear()
        return Observation(
            vector=vector,
            batch_size=self._batch_size,
            waiting_requests=self._waiting,
            kv_use=self._kv_use,
            steps_used=self._steps_used,
            last_decision=self._last_decision,
            steps_since_switch=self._steps_since_switch,
            accept_rate=rates,
            expected_accepted=expected,
            latency_pred_s=latency,
            kv_used_tokens=self._kv_used_tokens,
            new_records=new_records,
        )

    @staticmethod
    def _regressors(batch_size: int, steps: int, kv_tokens: int) -> np.ndarray:
        b = batch_size / 64.0
        return np.array([1.0, b, float(steps), steps * b, kv_tokens / 1e5])
