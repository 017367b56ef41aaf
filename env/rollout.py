"""Running a policy against the simulator, the way a real server would see it.

:class:`DecisionLoop` couples a :class:`~env.sim.simulator.Simulator` with the
feature module under the feedback lag of overlap scheduling: the decision for
step M sees telemetry of steps <= M - ``feedback_lag`` only. It also does the
episode's time accounting (a fixed horizon, the step that crosses it prorated),
which both the gymnasium environment's reward and the reported throughput use,
so the two can never disagree. :func:`rollout` runs a whole episode.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from env.features import FeatureBuilder, FeatureSpec, Observation
from env.probe import ProbeSpec
from env.sim.simulator import Simulator
from env.traces.schema import StepRecord


class Policy(Protocol):
    """Observation in, speculation steps out (see :mod:`agents.policies`)."""

    name: str

    def reset(self, sim: Simulator | None = None) -> None: ...

    def act(self, obs: Observation) -> int: ...


@dataclass(frozen=True)
class StepOutcome:
    """What one decision led to, within the horizon.

    ``tokens`` counts every output token committed between this decision and
    the next (prefill steps' first tokens included); ``elapsed_s`` the
    simulated time that took; both prorated for the step crossing the horizon.
    ``slo_violating_tokens`` counts tokens of requests whose per-token latency
    in the decode step exceeded the TPOT SLO.
    """

    record: StepRecord
    tokens: float
    elapsed_s: float
    slo_violating_tokens: float
    truncated: bool
    terminated: bool


class DecisionLoop:
    """Decision-by-decision driver of a simulator (used by the env and by rollouts).

    Args:
        sim: the simulator (reset by :meth:`reset`).
        feature_spec: layout of the observation.
        feedback_lag: a decision for step M sees records of steps <= M - lag.
        horizon_s: episode length in simulated seconds (None: run until done).
        slo_tpot_s: per-token latency target for the SLO accounting (None: off).
        cost_prior: the cost profile the feature module assumes (what the
            controller would be configured with; None: telemetry only).
        features: the feature builder to fold telemetry into (None: a new one from
            ``feature_spec`` and ``cost_prior``); with :meth:`reset`'s ``keep_features``
            one builder carries a controller stream's estimators from run to run.
        probe: the acceptance probe a new feature builder keeps the budget of (the
            served policy's, :mod:`env.probe`; None: none).
    """

    def __init__(self, sim: Simulator, feature_spec: FeatureSpec | None = None,
                 feedback_lag: int = 3, horizon_s: float | None = None,
                 slo_tpot_s: float | None = None, cost_prior=None,
                 features: FeatureBuilder | None = None,
                 probe: ProbeSpec | None = None) -> None:
        if feedback_lag < 1:
            raise ValueError("feedback_lag must be >= 1 (a step's own result is never known)")
        self.sim = sim
        self.features = features if features is not None else FeatureBuilder(
            feature_spec, cost_prior, probe=probe)
        self.feedback_lag = feedback_lag
        self.horizon_s = horizon_s
        self.slo_tpot_s = slo_tpot_s
        self._pending: deque[StepRecord] = deque()
        #: Whether the decision on the latest observation is unheld (Observation.unheld).
        self._unheld = False

    @property
    def end_s(self) -> float:
        """Simulated time at which the episode ends."""
        return float("inf") if self.horizon_s is None else self.horizon_s

    def reset(self, seed: int | None = None, observe: bool = True,
              keep_features: bool = False) -> Observation | None:
        """Start an episode; returns the first observation (None if nothing to do).

        With ``observe=False`` no observation is built (for fixed-depth replays);
        ``keep_features=True`` keeps what the feature builder has seen (a real
        controller's stream lives on from one load to the next on one server).
        """
        self.sim.reset(seed)
        if not keep_features:
            self.features.reset()
        self._pending.clear()
        self._unheld = False
        self.tokens = 0.0
        self.elapsed_s = 0.0
        self.slo_violating_tokens = 0.0
        self.decisions = 0
        self.steps_chosen = np.zeros(self.sim.config.max_depth + 1, dtype=np.int64)
        self.warmups = 0
        tokens0 = self.sim.output_tokens_total
        self._pending.extend(self.sim.advance())
        tokens, elapsed, _ = self._clip_to_horizon(0.0, self.sim.time_s,
                                                   self.sim.output_tokens_total - tokens0)
        self.tokens += tokens
        self.elapsed_s += elapsed
        if self.finished or not observe:
            return None
        return self._observe()

    def flush(self) -> None:
        """Fold every record the feedback lag still holds back into the features: what a
        real controller has received by the time a later load begins on the same server
        (``keep_features``)."""
        while self._pending:
            self.features.update(self._pending.popleft())

    @property
    def finished(self) -> bool:
        """True when the horizon is reached or the simulator has nothing left."""
        return self.sim.time_s >= self.end_s or self.sim.done

    def step(self, depth: int, observe: bool = True) -> tuple[Observation | None, StepOutcome]:
        """Run the due decode step at ``depth``, then everything up to the next one."""
        sim = self.sim
        t0, tokens0 = sim.time_s, sim.output_tokens_total
        asked = min(max(int(depth), 0), sim.config.max_depth)
        # The start rule (ProbeSpec.start_off): a decision the plugin does not hold, and
        # the decider's count of the speculative steps its decisions run.
        # (``start_depth``: decided says which of the rule's decisions are unheld)
        if self._unheld and self.features.decided(asked):
            record = sim.decode(asked, unheld=True)
        else:
            record = sim.decode(asked)
        self.decisions += 1
        # The depth decided, which is the depth run except at a warm-up (a step asked for
        # depth > 0 right after off runs SGLang's steps=0 once: ``reentry_warmup``) and
        # while the plugin holds a depth (``min_switch_steps``).
        self.steps_chosen[asked] += 1
        self.warmups += sim.last_warmup
        violating = self._slo_violations(record)
        self._pending.append(record)
        if sim.time_s < self.end_s:
            self._pending.extend(sim.advance())
        tokens, elapsed, fraction = self._clip_to_horizon(t0, sim.time_s,
                                                         sim.output_tokens_total - tokens0)
        violating *= fraction
        self.tokens += tokens
        self.elapsed_s += elapsed
        self.slo_violating_tokens += violating
        truncated = sim.time_s >= self.end_s
        terminated = sim.done and not truncated
        obs = None if (truncated or terminated or not observe) else self._observe()
        return obs, StepOutcome(record, tokens, elapsed, violating, truncated, terminated)

    def run_static(self, depth: int, seed: int | None = None) -> float:
        """Replay the whole episode at a fixed depth; returns its throughput (fast path)."""
        self.reset(seed, observe=False)
        while not self.finished:
            self.step(depth, observe=False)
        return self.throughput_tok_s

    @property
    def throughput_tok_s(self) -> float:
        """Output tokens per second of simulated time over the episode so far."""
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    # -- internals --------------------------------------------------------------

    def _clip_to_horizon(self, t0: float, t1: float, tokens: int) -> tuple[float, float, float]:
        end = self.end_s
        if t1 <= end or t1 <= t0:
            return float(tokens), t1 - t0, 1.0
        fraction = max(0.0, end - t0) / (t1 - t0)
        return tokens * fraction, max(0.0, end - t0), fraction

    def _slo_violations(self, record: StepRecord) -> float:
        if self.slo_tpot_s is None:
            return 0.0
        per_request_tokens = (
            record.accepted_drafts.astype(np.int64) + 1
            if record.accepted_drafts.size
            else np.ones(record.batch_size, dtype=np.int64)
        )
        slow = record.step_latency_s / per_request_tokens > self.slo_tpot_s
        return float(per_request_tokens[slow].sum())

    def _observe(self) -> Observation:
        # The next decode step gets index sim.step_index; it may see steps <= index - lag.
        visible_up_to = self.sim.step_index - self.feedback_lag
        pending = self._pending
        while pending and pending[0].step_index <= visible_up_to:
            self.features.update(pending.popleft())
        obs = self.features.observation(self.sim.batch_size)
        self._unheld = obs.unheld
        return obs


@dataclass(frozen=True)
class RunResult:
    """Outcome of one policy on one workload."""

    policy: str
    throughput_tok_s: float
    mean_tpot_ms: float
    mean_e2e_s: float
    mean_ttft_s: float
    output_tokens: float
    elapsed_s: float
    finished_requests: int
    decisions: int
    steps_chosen: list[int]
    slo_goodput_tok_s: float | None = None
    #: Decisions for depth > 0 that ran as the warm-up after off (counted in
    #: ``steps_chosen`` at the depth decided).
    warmups: int = 0

    def as_dict(self) -> dict:
        """JSON-friendly form."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def rollout(loop: DecisionLoop, policy: Policy, seed: int | None = None,
            keep_features: bool = False) -> RunResult:
    """Run ``policy`` for one episode of ``loop`` and summarise it (``keep_features``:
    see :meth:`DecisionLoop.reset`). A policy with an acceptance probe (``policy.probe``,
    e.g. :class:`agents.policies.ExportedPolicyAdapter`) has the loop's features keep its
    budget, as a serving decider's do (:mod:`env.probe`)."""
    probe = getattr(policy, "probe", None)
    if probe is not None:
        loop.features.set_probe(probe)
    obs = loop.reset(seed, keep_features=keep_features)
    policy.reset(loop.sim)
    while obs is not None:
        obs, _ = loop.step(policy.act(obs))
    if keep_features:  # the stream lives on: its last records reach the controller too
        loop.flush()
    return summarise(loop, policy.name)


def summarise(loop: DecisionLoop, name: str) -> RunResult:
    """Metrics of the episode ``loop`` just ran."""
    stats = loop.sim.stats()
    tpot = stats.tpot_s
    e2e = stats.e2e_s
    started = ~np.isnan(stats.first_token_s)
    ttft = stats.first_token_s[started] - stats.arrival_s[started]
    slo = None
    if loop.slo_tpot_s is not None and loop.elapsed_s > 0:
        slo = (loop.tokens - loop.slo_violating_tokens) / loop.elapsed_s
    return RunResult(
        policy=name,
        throughput_tok_s=loop.throughput_tok_s,
        mean_tpot_ms=float(tpot.mean() * 1e3) if tpot.size else float("nan"),
        mean_e2e_s=float(e2e.mean()) if e2e.size else float("nan"),
        mean_ttft_s=float(ttft.mean()) if ttft.size else float("nan"),
        output_tokens=loop.tokens,
        elapsed_s=loop.elapsed_s,
        finished_requests=int(stats.finished.sum()),
        decisions=loop.decisions,
        steps_chosen=loop.steps_chosen.tolist(),
        slo_goodput_tok_s=slo,
        warmups=loop.warmups,
    )
