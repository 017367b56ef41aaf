"""Telemetry records -> policy observation: the one place this happens.

The gymnasium environment feeds the :class:`~env.traces.schema.StepRecord` s that the
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
  (the first speculative step after an off period is left out: it drafts from a
  cold draft state)
  (chain drafting makes every depth's acceptance observable from per-request
  accepted counts: a request that accepted ``a`` drafts at depth ``d`` is a
  success at positions 1..a and, if ``a < d``, a failure at ``a + 1``);
* cost: step latency predicted for every depth at the current load: the
  server's cost profile when one is configured (fitted offline from the
  server's own recorded trace, see ``specctl-fit-profile``), plus a ridge
  regression of the observed residual on (batch size, speculation on, extra
  draft steps, KV tokens) with exponential forgetting. Without a profile the
  regression models the whole latency from a generic prior: then the cost of a
  depth the server has not run recently is a guess (chain telemetry cannot
  show the cost of a depth that is never used), which is why serving with a
  profile is recommended;
* their combination: the estimated goodput of each depth relative to no
  speculation, ``(1 + E[accepted | d]) / latency(d)``;
* what is measured and what is assumed: per depth, how many recent steps ran at
  that depth (exponentially forgotten, as the latency regression: a depth never
  run has a cost that is only the prior's guess), whether a cost profile was
  given, and how far the measured latencies sit from the profile's
  prediction (a wrong or swapped profile shows here within a few steps);
* control state: the steps of the latest step, steps since the last switch, and
  how stale the acceptance estimate is. (Not the policy's own last decision:
  online the controller sends a choice per batch size and learns which one the
  server applied only from telemetry, so training must not use it either.)
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from env.traces.schema import StepRecord

#: Bump when the meaning or order of the observation vector changes.
#: 2: per-depth cost confidence, cost-profile presence and error (after log_throughput).
FEATURE_VERSION = 2


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
    #: Records fed since the previous observation, oldest first.
    new_records: tuple[StepRecord, ...] = field(default=())


class FeatureBuilder:
    """Folds a stream of step records into the current observation.

    Feed records in step order with :meth:`update`; read the observation with
    :meth:`observation` (or :meth:`observation_grid` for every grid batch size).
    """

    def __init__(self, spec: FeatureSpec | None = None, cost_prior=None) -> None:
        """
        Args:
            spec: the observation layout and estimator settings.
            cost_prior: optional cost profile of the server (anything with
                ``step_latency_s`` and ``step_latency_array``, e.g.
                :class:`env.sim.cost_model.CostProfile`): the latency model's prior mean.
        """
        self.spec = spec or FeatureSpec()
        self.cost_prior = cost_prior
        self.reset()

    def reset(self) -> None:
        """Forget all telemetry."""
        depth = self.spec.max_depth
        self._trials = np.zeros(depth)
        self._successes = np.zeros(depth)
        # Latency regression on x = [1, b, s, s*b, m, m*b, kv] with b = batch/64,
        # s = 1 if speculating, m = draft forwards beyond the first (depth - 1),
        # kv = tokens/1e5: the cost model's structure (verify + extend switch on
        # with speculation; each further depth adds a draft forward).
        self._xtx = np.zeros((7, 7))
        self._xty = np.zeros(7)
        self._theta: np.ndarray | None = None
        depths = np.arange(self.spec.max_depth + 1, dtype=float)[None, :]
        self._depths = depths.astype(int)
        self._design_cache: dict[tuple, tuple] = {}
        self._speculating = (depths > 0).astype(float)
        self._extra_drafts = np.maximum(depths - 1.0, 0.0)
        self._latency_ms_ema: float | None = None
        self._depth_samples = np.zeros(self.spec.max_depth + 1)
        self._prior_log_error = 0.0
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
        self._steps_since_acceptance = 10**6
        self._new_records: list[StepRecord] = []

    # -- input ---------------------------------------------------------------

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
        # The first speculative step after speculation was off drafts from a cold draft
        # state: its acceptance says how re-entry goes, not how this traffic accepts.
        reentry = steps > 0 and self._steps_used == 0
        if steps != self._steps_used:
            self._steps_since_switch = 0
        else:
            self._steps_since_switch += 1
        self._steps_used = steps

        latency_s = record.step_latency_s
        if latency_s > 0.0:
            latency_ms = latency_s * 1e3
            residual_ms = latency_ms
            if self.cost_prior is not None:
                prior_ms = 1e3 * self.cost_prior.step_latency_s(
                    batch, steps, record.kv_used_tokens, 0, **_latency_flags(steps))
                residual_ms -= prior_ms
                error = math.log(latency_ms / max(prior_ms, 1e-6))
                self._prior_log_error += alpha * (error - self._prior_log_error)
            x = self._regressors(batch, steps, record.kv_used_tokens)
            forget = spec.latency_forgetting
            self._depth_samples *= forget
            self._depth_samples[steps] += 1.0
            self._xtx *= forget
            self._xty *= forget
            self._xtx += np.outer(x, x)
            self._xty += x * residual_ms
            self._theta = None
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
        if steps > 0 and accepted.size and not reentry:
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
        return np.array(self._accept_rates())

    def _accept_rates(self) -> list[float]:
        # Each position's prior is the estimate of the position before it.
        prior = self.spec.accept_prior_first
        strength = self.spec.accept_prior_strength
        rates = []
        for trials, successes in zip(self._trials.tolist(), self._successes.tolist(), strict=True):
            prior = (successes + strength * prior) / (trials + strength)
            rates.append(prior)
        return rates

    def _expected_accepted(self, rates: list[float]) -> np.ndarray:
        expected, reach, total = [0.0], 1.0, 0.0
        for rate in rates:
            reach *= rate
            total += reach
            expected.append(total)
        return np.array(expected)

    def latency_predictions_s(self, batch_sizes: np.ndarray | int) -> np.ndarray:
        """Predicted step latency (s) of every depth 0..max_depth at each batch size.

        Returns shape ``(len(batch_sizes), max_depth + 1)`` (or ``(max_depth + 1,)``
        for a scalar), at the latest KV use.
        """
        scalar = np.ndim(batch_sizes) == 0
        batch_sizes = np.atleast_1d(batch_sizes)
        design, prior = self._design(batch_sizes)
        theta = self._latency_theta()
        # The KV column is left out of the cached design: it is the same for every row.
        predicted = design @ theta[:6] + (theta[6] * (self._kv_used_tokens / 1e5))
        if prior is not None:
            at0, slope = prior
            predicted += at0 + slope * self._kv_used_tokens
        # Physically a deeper draft never costs less; keep the prediction sane.
        base_ms = self._latency_ms_ema if self._latency_ms_ema is not None else 10.0
        floor = max(0.05 * base_ms, 1e-3)
        predicted = np.maximum.accumulate(np.maximum(predicted, floor), axis=1) * 1e-3
        return predicted[0] if scalar else predicted

    def _design(self, batch_sizes: np.ndarray):
        """Per set of batch sizes (cached): the regression's design for every depth,
        shape (n, depth + 1, 6), and the cost profile's latency (ms) at KV 0 and its
        slope per KV token (the profile's KV term is linear), or None without a profile.

        Building these per decision was most of the controller's time.
        """
        key = tuple(batch_sizes.tolist())
        cached = self._design_cache.get(key)
        if cached is None:
            batches, depths = np.broadcast_arrays(np.maximum(batch_sizes, 1)[:, None],
                                                  self._depths)
            b = batches / 64.0
            s = self._speculating + 0.0 * b
            m = self._extra_drafts + 0.0 * b
            design = np.stack([np.ones_like(b), b, s, s * b, m, m * b], axis=-1)
            prior = None
            if self.cost_prior is not None:
                flat_b, flat_d = batches.ravel(), depths.ravel()
                flags = {"draft_extend": flat_d > 0, "speculative_path": flat_d > 0}
                at0 = 1e3 * self.cost_prior.step_latency_array(flat_b, flat_d, 0, 0, **flags)
                at1 = 1e3 * self.cost_prior.step_latency_array(flat_b, flat_d, 100_000, 0,
                                                               **flags)
                prior = (at0.reshape(b.shape), ((at1 - at0) / 100_000).reshape(b.shape))
            cached = self._design_cache[key] = (design, prior)
        return cached

    def _latency_theta(self) -> np.ndarray:
        if self._theta is None:
            spec = self.spec
            base_ms = self._latency_ms_ema if self._latency_ms_ema is not None else 10.0
            if self.cost_prior is not None:
                prior = np.zeros(7)  # the residual over the profile: none expected
            else:
                # The observed level at depth 0, fixed fractions of it for speculating.
                prior = np.array([base_ms, 0.0, spec.speculation_prior_fraction * base_ms, 0.0,
                                  spec.draft_step_prior_fraction * base_ms, 0.0, 0.0])
            ridge = spec.latency_ridge
            self._theta = np.linalg.solve(self._xtx + ridge * np.eye(7), self._xty + ridge * prior)
        return self._theta

    def observation(self, batch_size: int | None = None) -> Observation:
        """The observation after all records fed so far.

        Args:
            batch_size: size of the batch the decision is for, when known (the
                server knows it when it asks); defaults to the latest decode
                step's. The vector uses its grid floor (see ``batch_grid``).
        """
        if batch_size is None:
            batch_size = self._batch_size
        rates = self._accept_rates()
        expected = self._expected_accepted(rates)
        quantised = self.spec.grid_floor(batch_size)
        latency = self.latency_predictions_s(np.array([quantised, batch_size]))
        vector = self._vectors(np.array([quantised]), rates, expected, latency[:1])[0]
        new_records = tuple(self._new_records)
        self._new_records.clear()
        return Observation(
            vector=vector,
            batch_size=int(batch_size),
            waiting_requests=self._waiting,
            kv_use=self._kv_use,
            steps_used=self._steps_used,
            steps_since_switch=self._steps_since_switch,
            accept_rate=np.array(rates),
            expected_accepted=expected,
            latency_pred_s=latency[1],
            kv_used_tokens=self._kv_used_tokens,
            cost_samples=self._depth_samples.copy(),
            new_records=new_records,
        )

    def observation_grid(self) -> np.ndarray:
        """Observation vectors for every ``batch_grid`` batch size, shape (grid, size).

        Row i equals ``observation(batch_grid[i]).vector``; the controller
        evaluates the policy on all rows and sends one decision per grid value.
        """
        grid = np.asarray(self.spec.batch_grid)
        rates = self._accept_rates()
        expected = self._expected_accepted(rates)
        self._new_records.clear()
        return self._vectors(grid, rates, expected, self.latency_predictions_s(grid))

    def _vectors(self, batch_sizes: np.ndarray, rates: list[float], expected: np.ndarray,
                 latency: np.ndarray) -> np.ndarray:
        spec = self.spec
        depth = spec.max_depth
        # log(latency_d / latency_0), and log goodput ratios from it: few small-array ops,
        # since this runs for every decision the controller makes.
        log_latency = np.log(latency)
        slower = log_latency[:, 1:] - log_latency[:, :1]
        log_tokens = np.log1p(expected)
        # np.minimum/np.maximum, not np.clip: the ufuncs cost a third of clip's overhead.
        relative_goodput = np.maximum(np.minimum((log_tokens[1:] - log_tokens[0]) - slower, 3.0),
                                      -3.0) / 3.0
        relative_latency = np.minimum(slower, 3.0) / 3.0  # >= 0: latency is monotone in depth
        confidence_scale = 1.0 / math.log1p(1e4)
        switch_scale = 1.0 / math.log1p(spec.switch_scale)
        shared = [
            math.log1p(self._waiting) / math.log1p(spec.waiting_scale),
            self._kv_use,
            max(-1.0, min(1.0, self._batch_trend * 10.0)),
            self._prefill_share,
            self._steps_used / depth,
            math.log1p(self._steps_since_switch) * switch_scale,
            min(1.0, math.log1p(self._steps_since_acceptance) * switch_scale),
            *rates,
            *[min(1.0, math.log1p(t) * confidence_scale) for t in self._trials.tolist()],
            math.log1p(self._latency_ms_ema or 0.0) / math.log1p(1000.0),
        ]
        out = np.empty((len(batch_sizes), spec.size), dtype=np.float32)
        out[:, 0] = np.log1p(batch_sizes) / math.log1p(spec.batch_scale)
        tail = 1 + len(shared)
        out[:, 1:tail] = shared
        out[:, tail:tail + depth] = relative_latency
        out[:, tail + depth:tail + 2 * depth] = relative_goodput
        out[:, tail + 2 * depth] = math.log1p(self._throughput_ema or 0.0) / math.log1p(1e6)
        tail += 2 * depth + 1
        out[:, tail:tail + depth + 1] = np.log1p(self._depth_samples) * confidence_scale
        out[:, tail + depth + 1] = 1.0 if self.cost_prior is not None else 0.0
        out[:, tail + depth + 2] = self._prior_log_error  # log(measured / profile), saturates
        # Extreme loads (e.g. thousands waiting) saturate rather than leave the box.
        np.minimum(out, 1.0, out=out)
        return np.maximum(out, -1.0, out=out)

    @staticmethod
    def _regressors(batch_size: int, steps: int, kv_tokens: int) -> np.ndarray:
        b = batch_size / 64.0
        s = 1.0 if steps > 0 else 0.0
        m = max(steps - 1, 0)
        return np.array([1.0, b, s, s * b, m, m * b, kv_tokens / 1e5])


def _latency_flags(steps: int) -> dict[str, bool]:
    """How a step of ``steps`` runs when the controller drives the server: steps 0 is
    the plugin's real off switch (no speculative path, no draft extend)."""
    on = steps > 0
    return {"draft_extend": on, "speculative_path": on}
