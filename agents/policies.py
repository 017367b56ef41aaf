"""Speculation policies: observation in, speculation steps out.

Every policy implements :class:`Policy`: ``reset(sim)`` before an episode and
``act(obs) -> steps`` before every decode step, where ``obs`` is an
:class:`env.features.Observation` built from the (lagged) telemetry and the
batch size of the step being decided. Names, as used on the command line and in
``results.json``:

=====================  ===================================================================
``no_spec``            never speculate
``static_<d>``         always depth ``d`` (``static_3`` is EAGLE-3's usual chain of 3)
``table``              static per-batch-size table (vLLM V1 "dynamic SD" style)
``sglang_adaptive``    SGLang 0.5.23 ``--speculative-adaptive``: EMA of accepted drafts per
                       batch-size bucket, re-decided every few verify steps, hysteresis
``goodput_greedy``     online acceptance estimate + the cost profile handed to the
                       controller: the depth maximising expected tokens per second
                       (TurboSpec-like)
``goodput_explore``    ``goodput_greedy``, except where the observation's own estimate
                       prefers a depth whose cost was not measured lately: then it
                       measures (with the true profile: the kick-start teacher)
``goodput_online``     the same rule on the feature module's estimates (profile as prior,
                       corrected by measured step latencies), probing a depth whose cost
                       has not been measured lately: the best hand-written rule on the
                       inputs the learned policy sees
``oracle``             hindsight: knows every request's true acceptance, picks the
                       per-step best (not achievable online; an upper reference)
``ppo``                an exported PPO policy (see :mod:`controller.policy_file`)
=====================  ===================================================================
"""

from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from env.features import FeatureSpec, Observation
from env.guard import apply_guard, guard_columns
from env.probe import apply_probe
from env.sim.simulator import WARMUP_LATENCY_FLAGS, SchedulerConfig

#: vLLM V1's documented EAGLE-3 example: [[min_batch, max_batch, steps], ...].
VLLM_EAGLE3_TABLE: tuple[tuple[int, int, int], ...] = (
    (1, 16, 5), (17, 32, 4), (33, 64, 3), (65, 128, 1), (129, 512, 0),
)

#: SGLang 0.5.23's default ``--speculative-adaptive-config``, in SGLang's own JSON layout
#: (``sglang/srt/speculative/adaptive_spec_params.py``: ``DEFAULT_ADAPTIVE_CONFIG``; keys are
#: the smallest batch size of each bucket). Entries may also set ``ema_alpha`` (0.2),
#: ``update_interval`` (5), ``warmup_batches`` (10) and ``ceiling_coeff`` (0).
SGLANG_DEFAULT_CONFIG: dict[str, dict] = {
    "1": {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25,
          "ceiling_coeff": 0},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0,
          "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0,
           "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0,
           "ceiling_coeff": 0},
}


class Policy(ABC):
    """Chooses the speculation steps (0 = none) of each decode step."""

    name: str = "policy"

    def reset(self, sim=None) -> None:  # noqa: B027 - optional hook
        """Forget per-episode state. ``sim`` is given for hindsight policies only."""

    @abstractmethod
    def act(self, obs: Observation) -> int:
        """Steps for the decode step described by ``obs``."""

    def feature_spec(self, default: FeatureSpec) -> FeatureSpec:
        """The features this policy must be fed: ``default`` (the environment's), except
        for a trained policy, whose file fixes its own (e.g. its latency model)."""
        return default


class StaticPolicy(Policy):
    """Always the same depth (0 = no speculation)."""

    def __init__(self, steps: int) -> None:
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.steps = steps
        self.name = "no_spec" if steps == 0 else f"static_{steps}"

    def act(self, obs: Observation) -> int:
        return self.steps


class StaticTablePolicy(Policy):
    """Depth by batch size from a fixed table (vLLM V1 ``num_speculative_tokens_per_batch_size``).

    Batch sizes outside every row get 0.
    """

    name = "table"

    def __init__(self, table: Sequence[Sequence[int]] = VLLM_EAGLE3_TABLE,
                 max_depth: int | None = None) -> None:
        rows = sorted((int(lo), int(hi), int(k)) for lo, hi, k in table)
        for lo, hi, k in rows:
            if lo > hi or k < 0:
                raise ValueError(f"bad table row [{lo}, {hi}, {k}]")
        self._lows = [lo for lo, _, _ in rows]
        self._rows = [(hi, k if max_depth is None else min(k, max_depth)) for _, hi, k in rows]

    def act(self, obs: Observation) -> int:
        i = bisect.bisect_right(self._lows, obs.batch_size) - 1
        if i < 0:
            return 0
        hi, steps = self._rows[i]
        return steps if obs.batch_size <= hi else 0


def sglang_cuda_graph_bs(max_bs: int = 64) -> list[int]:
    """The decode batch sizes SGLang 0.5.x captures as CUDA graphs on a speculative server.

    ``ServerArgs._generate_decode_cuda_graph_batch_sizes`` (speculative branch) up to
    ``--cuda-graph-max-bs`` (64 on the project's H200 servers). SGLang's adaptive rule pads
    a batch to the next of these before picking its bucket.
    """
    sizes = (list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4))
             + list(range(72, 257, 8)) + list(range(272, max_bs + 1, 16)))
    sizes = [b for b in sizes if b <= max_bs]
    return sizes if max_bs in sizes else [*sizes, max_bs]


@dataclass
class _AdaptiveSlot:
    """One batch-size bucket of SGLang's adaptive rule (SGLang's ``AdaptiveStepSlot``)."""

    candidates: tuple[int, ...]
    current: int
    ema: float
    alpha: float
    interval: int
    warmup: int
    down_hysteresis: float
    up_hysteresis: float
    ceiling_coeff: float
    batches: int = 0

    def update(self, accepted: np.ndarray, requests: int) -> None:
        """One verify of ``requests`` requests (``accepted`` drafts each; none recorded for a
        step without drafts, where SGLang reports 0 per request); re-decide every
        ``interval`` verifies. SGLang counts steps=0 steps too: they lead to the probe."""
        if requests == 0:
            return
        if self.current > 0:
            mean = float(accepted.mean()) if accepted.size else 0.0
            self.ema = (1 - self.alpha) * self.ema + self.alpha * mean
        self.batches += 1
        if self.batches <= self.warmup or (self.batches - self.warmup) % self.interval:
            return
        cands = self.candidates
        idx = old = cands.index(self.current)
        if self.current == 0:  # nothing measured while off: probe the next candidate up
            idx = min(idx + 1, len(cands) - 1)
            if cands[idx] > 0 and self.ema < 0:
                self.ema = float(cands[idx] - 1)
            self.current = cands[idx]
            return
        while idx > 0:
            prev = cands[idx - 1]
            if self.ema <= (0.5 if prev == 0 else prev - 0.5) + self.down_hysteresis:
                idx -= 1
            else:
                break
        if idx == old:
            while idx < len(cands) - 1 and self.ema > cands[idx] - 0.5 + self.up_hysteresis:
                idx += 1
        if self.ceiling_coeff > 0 and cands[idx] <= cands[old]:
            ceiling = max(1, math.ceil(self.ema * self.ceiling_coeff))
            while idx > 0 and cands[idx] > ceiling:
                idx -= 1
        self.current = cands[idx]


class SGLangAdaptivePolicy(Policy):
    """SGLang 0.5.23's ``--speculative-adaptive`` rule (``adaptive_spec_params.py``).

    ``config`` is SGLang's JSON layout (default :data:`SGLANG_DEFAULT_CONFIG`): per
    batch-size bucket (the largest key <= the batch size, after padding the batch to
    the next CUDA-graph size in ``cuda_graph_bs`` as SGLang does), an EMA (``ema_alpha``)
    of the mean accepted drafts per request, updated after every verify while
    speculating; after ``warmup_batches`` verifies, every ``update_interval`` verifies the
    depth moves down one candidate while the EMA is at most ``prev - 0.5 +
    down_hysteresis`` (0.5 when the lower candidate is 0), otherwise up while it exceeds
    ``current - 0.5 + up_hysteresis``. From steps=0 it probes the next candidate up
    (there is no acceptance to measure). Every bucket starts at ``initial_steps``
    (SGLang: ``--speculative-num-steps``) if it is a candidate, else at its middle
    candidate. It sees each verify result as the server does: through
    ``obs.new_records``. ``tests/test_policies.py`` checks it step by step against
    SGLang's own class.
    """

    name = "sglang_adaptive"

    def __init__(self, config: Mapping[str, Mapping] | None = None, initial_steps: int = 7,
                 cuda_graph_bs: Sequence[int] | None = None,
                 max_depth: int | None = None) -> None:
        config = SGLANG_DEFAULT_CONFIG if config is None else config
        buckets = {key: entry for key, entry in config.items() if key.isdigit()}
        if not buckets:
            raise ValueError("SGLang adaptive config: no integer batch-size key, e.g. "
                             '{"1": {"candidate_steps": [1, 3, 7]}}')
        defaults = {key: value for key, value in config.items() if not key.isdigit()}
        self._entries = {int(key): {**defaults, **entry} for key, entry in buckets.items()}
        for bound, entry in self._entries.items():
            steps = entry.get("candidate_steps")
            if not (isinstance(steps, Sequence) and steps
                    and all(isinstance(s, int) and s >= 0 for s in steps)):
                raise ValueError(f"SGLang adaptive config, bucket {bound}: candidate_steps "
                                 f"must be a non-empty list of ints >= 0, got {steps!r}")
        self._bounds = sorted(self._entries)
        self._graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs is not None else None
        self.initial_steps = initial_steps
        self.max_depth = max_depth
        self.reset()

    def reset(self, sim=None) -> None:
        self._slots: dict[int, _AdaptiveSlot] = {}
        for bound, entry in self._entries.items():
            cands = tuple(sorted({c if self.max_depth is None else min(c, self.max_depth)
                                  for c in entry["candidate_steps"]}))
            current = (self.initial_steps if self.initial_steps in cands
                       else cands[len(cands) // 2])
            self._slots[bound] = _AdaptiveSlot(
                cands, current, float(current - 1), alpha=entry.get("ema_alpha", 0.2),
                interval=entry.get("update_interval", 5),
                warmup=entry.get("warmup_batches", 10),
                down_hysteresis=entry.get("down_hysteresis", -0.25),
                up_hysteresis=entry.get("up_hysteresis", 0.0),
                ceiling_coeff=entry.get("ceiling_coeff", 0))

    def _slot(self, batch_size: int) -> _AdaptiveSlot:
        if self._graph_bs is not None:  # SGLang pads to the next CUDA-graph batch size
            i = bisect.bisect_left(self._graph_bs, batch_size)
            batch_size = self._graph_bs[i] if i < len(self._graph_bs) else batch_size
        i = bisect.bisect_right(self._bounds, batch_size) - 1
        return self._slots[self._bounds[max(i, 0)]]

    def act(self, obs: Observation) -> int:
        for record in obs.new_records:
            if record.is_decode:
                self._slot(record.batch_size).update(record.accepted_drafts,
                                                     record.batch_size)
        return self._slot(obs.batch_size).current


class _GreedyRule:
    """What both goodput rules share: hysteresis and probing acceptance while off.

    * A switch needs ``1 + hysteresis`` times the current depth's expected rate:
      near break-even a myopic rule flips on and off, and every return from off
      drafts from a cold state.
    * While off, no acceptance is measured, so an estimate made under different
      traffic would keep speculation off for good. Off steps earn a probing
      budget (``probe_share`` of their predicted time); once it covers the extra
      cost of ``probe_steps`` steps at ``probe_depth``, the rule speculates for
      that many steps (the first one back drafts from a cold state and the
      feature module leaves it out, so a probe is two steps).
    * Leaving speculation for off needs off to beat the running depth by
      ``off_hysteresis`` (0: the plain hysteresis): where the server makes requests
      that decoded while off lose acceptance for good, or the first step back keeps
      few of its drafts, a myopic step out of speculation near break-even is not
      undone (the H200 MoE at acceptance 2.5, 64 clients, with a stale-acceptance loss
      of 0.25: the rule went off on 45% of steps, 0.970x no speculation, where static 3
      serves 1.027x).
    """

    def __init__(self, max_depth: int, hysteresis: float = 0.03, probe_share: float = 0.01,
                 probe_depth: int = 1, probe_steps: int = 2, off_hysteresis: float = 0.0) -> None:
        self.max_depth = max_depth
        self.hysteresis = hysteresis
        self.off_hysteresis = off_hysteresis
        self.probe_share = probe_share
        self.probe_depth = min(probe_depth, max_depth)
        self.probe_steps = probe_steps
        self.reset()

    def reset(self, sim=None) -> None:
        self._budget_s = 0.0
        self._probing = 0

    def choose(self, rate: np.ndarray, latency_s: np.ndarray, current: int) -> int:
        """The depth to run, given the expected rate and latency of every depth and the
        depth the server ran last as telemetry shows it (observable, unlike this rule's
        own last choice, so a policy imitating the rule can see what it reacts to)."""
        current = min(max(current, 0), len(rate) - 1)
        if (current > 0 and self.off_hysteresis > 0.0 and rate[0] >= rate.max()
                and rate[0] <= rate[current] * (1.0 + self.off_hysteresis)):
            rate = rate.copy()
            rate[0] = -np.inf  # off does not beat the running depth by enough: stay on
        best = int(np.argmax(rate))
        if rate[best] <= rate[current] * (1.0 + self.hysteresis):
            best = current
        if self._probing:
            self._probing -= 1
            return self.probe_depth
        if best == 0:
            self._budget_s += self.probe_share * float(latency_s[0])
            extra = self.probe_steps * float(latency_s[self.probe_depth] - latency_s[0])
            if self._budget_s >= extra > 0:
                self._budget_s = 0.0
                self._probing = self.probe_steps - 1
                best = self.probe_depth
        return best


class GoodputGreedyPolicy(Policy):
    """Maximise expected tokens per second of the next step under the cost model.

    Expected accepted drafts per request at depth d come from the observation's
    online acceptance estimate; step latency from the cost profile at the
    decided batch size and the reported KV use (TurboSpec/SmartSpec-style),
    with the hysteresis and acceptance probing of :class:`_GreedyRule`.
    """

    name = "goodput_greedy"

    def __init__(self, profile, max_depth: int, sim_config: SchedulerConfig | None = None) -> None:
        self.profile = profile
        self.max_depth = max_depth
        self.config = sim_config or SchedulerConfig()
        self.rule = _GreedyRule(max_depth)

    def reset(self, sim=None) -> None:
        self.rule.reset()

    def act(self, obs: Observation, expected_accepted: np.ndarray | None = None) -> int:
        """The depth for ``obs``; ``expected_accepted`` (per depth) replaces the
        observation's acceptance estimate where given."""
        batch = max(obs.batch_size, 1)
        latency = np.array([self.profile.step_latency_s(
            batch, depth, obs.kv_used_tokens, 0, **self.config.latency_flags(depth))
            for depth in range(self.max_depth + 1)])
        if expected_accepted is None:
            expected_accepted = obs.expected_accepted
        rate = batch * (1.0 + expected_accepted[: self.max_depth + 1]) / latency
        return self.rule.choose(rate, latency, obs.steps_used)


class GoodputExplorePolicy(Policy):
    """:class:`GoodputGreedyPolicy`, measuring where the observation cannot tell.

    The kick-start teacher knows the true costs; the student sees only the feature
    module's estimates, which for a depth not run lately are the handed profile's
    or, without one, a generic prior's guess. Imitating the privileged choice
    there teaches the student to act on knowledge it does not have (e.g. never
    to try speculating on an unknown server). So where the estimate prefers a
    depth by more than ``margin`` over the greedy choice and that depth has fewer
    than ``min_samples`` recent cost measurements, this rule measures instead:
    its own choice if that is unmeasured too, else the cheapest depth that looks
    better and is unmeasured; a few steps later telemetry has measured it and the
    estimate moves to the truth.

    It also measures when the measured costs contradict the profile: if the depth
    running costs more than ``exp(contradiction)`` times the profile's prediction
    (the observation's recent cost-profile error), the profile's guesses for the
    cheaper depths not measured lately are suspect too (the latency regression
    charges most of the excess to every depth, but a verify cost that grows with
    the cached KV, say, is not paid by off at all). Then a cheaper unmeasured
    depth that would beat the running one by ``margin`` were its cost as far below
    its estimate as the measured one sits above the profile is measured (the
    cheapest such). On the H200 MoE at acceptance 2.5 the profile priced depth 3
    at half what the server measured, the estimate charged off with the same
    excess, and a policy never tried off, which served the load 30-40% faster.

    And while no acceptance has been measured at all and speculating looks within
    ``accept_margin`` of paying, it speculates at depth 1 to measure it: greedy
    escapes such a state only on a probe budget the student cannot see (a closed
    loop starting at batch 32 on the H200 kept the student off, 18% below static 3).
    The default 5% is narrow for large batches: at 64 clients on the H200 (batch 48,
    the server's cap) the prior's acceptance (0.7 per position) prices the best depth
    22% below off where the first position accepts 0.99 and depth 3 serves 1.07x off;
    greedy stays off for 351 steps until its hidden budget probes, the student for
    good. 0.25 measures there, at the price of a probe (and a look at the deepest
    depth) on servers where it does not pay: ``blackwell_tp8`` at batch 1 looks 12%
    below off on the prior.

    ``off_hysteresis``: the greedy rule's margin for leaving speculation for off
    (:class:`_GreedyRule`; 0, the default, keeps the teacher as it was).

    Every input of these decisions is in the observation vector (relative goodput,
    cost and acceptance confidence, the depth running and the cost-profile error),
    so a student can learn them.
    """

    name = "goodput_explore"

    def __init__(self, profile, max_depth: int, sim_config: SchedulerConfig | None = None,
                 margin: float = 0.1, min_samples: float = 1.0,
                 contradiction: float = 0.25, accept_margin: float = 0.05,
                 accept_prior_strength: float | None = None,
                 off_hysteresis: float = 0.0) -> None:
        if not off_hysteresis >= 0.0:
            raise ValueError(f"off_hysteresis must be >= 0, got {off_hysteresis}")
        if not 0.0 <= accept_margin < 1.0:
            raise ValueError(f"accept_margin must lie in [0, 1), got {accept_margin}")
        self.greedy = GoodputGreedyPolicy(profile, max_depth, sim_config)
        self.greedy.rule.off_hysteresis = float(off_hysteresis)
        self.max_depth = max_depth
        self.margin = margin
        self.min_samples = min_samples
        self.contradiction = contradiction
        self.accept_margin = accept_margin
        self.accept_prior_strength = accept_prior_strength
        self.spec = FeatureSpec(max_depth=max_depth)
        names = self.spec.names()
        self._accept_confidence = names.index("accept_confidence_1")
        self._has_profile = names.index("has_cost_profile")

    def reset(self, sim=None) -> None:
        self.greedy.reset(sim)

    def act(self, obs: Observation) -> int:
        expected = self.measured_expected(obs)
        choice = self.greedy.act(obs, expected)  # every step: the rule's probing budget runs on
        samples = obs.cost_samples[: self.max_depth + 1]
        if not samples.size:
            return choice
        latency = obs.latency_pred_s[: self.max_depth + 1]
        rate = (1.0 + expected[: self.max_depth + 1]) / latency
        if (choice == 0 and obs.vector[self._accept_confidence] <= 0.0
                and obs.vector[self._has_profile] > 0.0
                and rate[1:].max() >= rate[0] * (1.0 - self.accept_margin)):
            # No acceptance measured yet (e.g. a closed loop that starts at batch 32):
            # the estimate is the prior's guess, and, priced by the handed profile
            # (without one the costs are guesses too, and the rule below already
            # measures a depth that looks better), speculating looks within
            # accept_margin of paying. Measure it at the cheapest depth (greedy's own
            # probes run on a hidden budget a student cannot imitate; the deeper
            # positions' estimates start from the first's).
            return 1
        looks_better = rate > rate[choice] * (1.0 + self.margin)
        unmeasured = samples < self.min_samples
        best = int(np.argmax(rate))
        if not (looks_better[best] and unmeasured[best]):
            probe = self._contradiction_probe(obs, rate, unmeasured)
            return choice if probe is None else probe
        if unmeasured[choice]:
            return choice  # running the right depth measures it as well as any probe
        # The cheapest candidate first: it costs least to measure, and once the cost
        # of speculating at all is known, the deeper depths' guesses move with it.
        return int(np.flatnonzero(looks_better & unmeasured)[0])

    def measured_expected(self, obs: Observation) -> np.ndarray:
        """Expected accepted drafts per depth, with the acceptance estimate's prior
        weakened to ``accept_prior_strength`` pseudo-requests (None: the observation's own).

        The feature module pulls each position's rate toward a prior of 0.7 with 4
        pseudo-requests; at batch 1, with about 30 decayed trials, that keeps a server
        accepting 0.1 drafts per step looking like 0.2, enough to make depth 1 look
        worth running where it costs 15% more than off. The counts behind the estimate
        are in the vector (rate and trials per position), so the student can see what
        this rule sees.
        """
        strength = self.accept_prior_strength
        if strength is None:
            return obs.expected_accepted
        spec = self.spec
        vector_trials = obs.vector[self._accept_confidence:self._accept_confidence
                                   + spec.max_depth]
        trials = np.expm1(vector_trials * math.log1p(1e4))
        prior, reach, total = spec.accept_prior_first, 1.0, 0.0
        expected = [0.0]
        new_prior = spec.accept_prior_first
        for rate, trial in zip(obs.accept_rate, trials, strict=True):
            # Undo the feature module's prior (its prior is the previous position's rate).
            successes = max(0.0, rate * (trial + spec.accept_prior_strength)
                            - spec.accept_prior_strength * prior)
            prior = rate
            new_prior = (successes + strength * new_prior) / (trial + strength)
            new_prior = min(max(new_prior, 0.0), 1.0)
            reach *= new_prior
            total += reach
            expected.append(total)
        return np.asarray(expected)

    def _contradiction_probe(self, obs: Observation, rate: np.ndarray,
                             unmeasured: np.ndarray) -> int | None:
        """The cheapest unmeasured depth below the running one that would beat it if the
        profile's excess over the measured cost did not apply to it; None if none does
        or the measured costs do not contradict the profile (see the class docstring)."""
        error = min(obs.cost_profile_error, 1.0)  # the vector's entry is clipped there
        current = min(max(obs.steps_used, 0), len(rate) - 1)
        if error <= self.contradiction or unmeasured[current]:
            return None
        optimistic = rate[:current] * math.exp(error)
        candidates = unmeasured[:current] & (optimistic > rate[current] * (1.0 + self.margin))
        return int(np.flatnonzero(candidates)[0]) if candidates.any() else None


class GoodputOnlinePolicy(Policy):
    """Greedy expected tokens per second on the observation's own estimates.

    Latency per depth is the feature module's prediction (the handed profile, if
    any, corrected by measured latencies; a depth not measured lately costs the
    prior's guess), so it explores: until depths 0, 1 and the deepest (which
    identify the latency model's off, speculation and per-draft terms) have each
    been measured, it runs the least measured of them every ``warmup_gap``
    decisions (a few, because telemetry lags); after that, every
    ``probe_every`` decisions, the least measured depth if it has fewer than
    ``min_samples`` recent measurements. Otherwise as :class:`_GreedyRule`.
    """

    name = "goodput_online"

    def __init__(self, max_depth: int, probe_every: int = 32, min_samples: float = 3.0,
                 warmup_gap: int = 4) -> None:
        self.max_depth = max_depth
        self.probe_every = probe_every
        self.min_samples = min_samples
        self.warmup_gap = warmup_gap
        self._key_depths = np.array(sorted({0, 1, max_depth}))
        self.rule = _GreedyRule(max_depth)
        self.reset()

    def reset(self, sim=None) -> None:
        self._decisions = 0
        self._last_probe = -10**9
        self.rule.reset()

    def act(self, obs: Observation) -> int:
        self._decisions += 1
        samples = obs.cost_samples
        since = self._decisions - self._last_probe
        if samples.size:
            key = samples[self._key_depths]
            if key.min() < 1.0 and since >= self.warmup_gap:
                self._last_probe = self._decisions
                return int(self._key_depths[int(np.argmin(key))])
            least = int(np.argmin(samples))
            if samples[least] < self.min_samples and since >= self.probe_every:
                self._last_probe = self._decisions
                return least
        latency = obs.latency_pred_s[: self.max_depth + 1]
        rate = (1.0 + obs.expected_accepted[: self.max_depth + 1]) / latency
        return self.rule.choose(rate, latency, obs.steps_used)


class OraclePolicy(Policy):
    """Hindsight per-step best: true acceptance of every running request, true cost.

    Not realisable online (it reads the simulator's acceptance tables); it is the
    reference that ``oracle_fraction`` is measured against. Where the step would be the
    warm-up (``Simulator.warmup_due``: the first step back on after off runs SGLang's
    steps=0 once, ``SchedulerConfig.reentry_warmup``), a depth > 0 is priced as that
    warm-up and the drafting step after it together (one step alone would never pay:
    the warm-up commits what off does, at a higher cost).

    A step is priced at its own latency also where the profile books the next prefill's
    launch on it (``CostProfile.prefill_launch_s``): the simulator moves that time from
    the prefill, which is as long in all as without the booking whatever the depth, so a
    depth's cost to the episode is its own latency (pricing the booking too would favour
    the depths that hide more of it for no time saved).
    """

    name = "oracle"

    def __init__(self, profile, max_depth: int) -> None:
        self.profile = profile
        self.max_depth = max_depth
        self._sim = None

    def reset(self, sim=None) -> None:
        if sim is None:
            raise ValueError("the oracle needs the simulator (reset(sim))")
        self._sim = sim

    def act(self, obs: Observation) -> int:
        sim = self._sim
        cfg = sim.config
        n = sim.batch_size
        remaining = sim.remaining_tokens()
        warmup = sim.warmup_due
        if warmup:  # what the warm-up step commits and costs, and leaves to do after it
            live = remaining > 0
            warm_tokens = int(live.sum())
            warm_s = self.profile.step_latency_s(n, 0, sim.kv_used, 0, **WARMUP_LATENCY_FLAGS)
            remaining = remaining - live
        best, best_rate = 0, -math.inf
        for depth in range(self.max_depth + 1):
            if not depth:
                tokens, latency = n, self.profile.step_latency_s(n, 0, sim.kv_used, 0,
                                                                 **cfg.latency_flags(0))
            else:
                accepted = sim.true_accepted(depth, after_warmup=warmup)
                tokens = np.minimum(accepted + 1, remaining).sum()
                if warmup:
                    tokens += warm_tokens
                    latency = warm_s + self.profile.step_latency_s(
                        n, depth, sim.kv_used + warm_tokens, 0, **cfg.latency_flags(depth))
                else:
                    latency = self.profile.step_latency_s(n, depth, sim.kv_used, 0,
                                                          **cfg.latency_flags(depth))
            rate = tokens / latency
            if rate > best_rate:
                best, best_rate = depth, rate
        return best


class ExportedPolicyAdapter(Policy):
    """An exported (numpy) PPO policy, acting on ``obs.vector``, with its acceptance probe
    (:mod:`env.probe`) applied as ``specctl-serve`` and local mode apply it.

    ``candidates``: the steps the served server offers (its HELLO's ``candidate_steps``;
    ``scripts/h200/offswitch.py``'s servers offer 0, 1, 3, 5): the policy's other actions
    are masked out before the arg-max and for the guard and the probe, as
    :func:`controller.decider.evaluate` masks them (None: every action, as before).
    """

    def __init__(self, exported, name: str = "ppo", probe=None, guard=None,
                 candidates: Sequence[int] | None = None) -> None:
        self.exported = exported
        self.name = name
        #: The probe (None: the policy file's); the features must keep its budget
        #: (DecisionLoop(probe=...)): obs.probing says when it is due.
        self.probe = exported.probe if probe is None else probe
        #: The goodput guard (:mod:`env.guard`; None: the policy file's).
        self.guard = exported.guard if guard is None else guard
        self._columns = guard_columns(exported.feature_spec)
        self._actions = np.asarray(exported.actions)
        self._allowed: np.ndarray | None = None
        if candidates is not None:
            from controller.decider import allowed_actions

            self._allowed = allowed_actions(self._actions, candidates)
            if self._allowed is not None and not self._allowed.any():
                raise ValueError(f"no action of the policy ({exported.actions}) is among "
                                 f"the candidates {list(candidates)}")

    def feature_spec(self, default: FeatureSpec) -> FeatureSpec:
        return self.exported.feature_spec

    def act(self, obs: Observation) -> int:
        vector = obs.vector.reshape(1, -1)
        logits = self.exported.logits(vector)
        allowed = self._allowed
        if allowed is not None:  # -inf where the server cannot run the action
            logits = logits + np.where(allowed, 0.0, -np.inf)[None, :]
        index = np.argmax(logits, axis=-1).reshape(1, 1)
        # The guard first, then the probe: as controller.decider.evaluate applies them.
        apply_guard(self.guard, self._columns, vector, index, self._actions, [allowed])
        if obs.probing:  # the features' probe budget: see DecisionLoop's ``probe``
            apply_probe(self.probe, index, self._actions, [obs.probing], [allowed], vector,
                        self._columns.latency)
        return int(self._actions[index[0, 0]])


#: The policy names ``make_policy`` knows (``static_<d>``: any depth 0..max_depth).
POLICY_NAMES = ("no_spec", "static_<d>", "table", "sglang_adaptive", "goodput_greedy",
                "goodput_explore", "goodput_online", "oracle", "ppo")


def make_policy(name: str, *, profile=None, max_depth: int = 7, policy_path: str | None = None,
                sim_config: SchedulerConfig | None = None,
                options: dict | None = None, probe=None, guard=None,
                candidates: Sequence[int] | None = None) -> Policy:
    """Build a policy from its command-line name (see the module docstring).

    ``options``: keyword arguments of ``goodput_explore``'s constructor (e.g.
    ``accept_prior_strength``); no other policy takes any. ``probe``: the acceptance probe
    (:class:`env.probe.ProbeSpec`) ``ppo`` runs with instead of its file's (None: the
    file's); ``guard``: its goodput guard (:class:`env.guard.GuardSpec`) likewise;
    ``candidates``: the steps the served server offers, ``ppo``'s other actions masked
    (:class:`ExportedPolicyAdapter`; None: all).
    """
    if probe is not None and name != "ppo":
        raise ValueError(f"policy {name!r} has no acceptance probe (only ppo)")
    if guard is not None and name != "ppo":
        raise ValueError(f"policy {name!r} has no goodput guard (only ppo)")
    if candidates is not None and name != "ppo":
        raise ValueError(f"policy {name!r} takes no candidate steps (only ppo)")
    if options and name != "goodput_explore":
        raise ValueError(f"policy {name!r} takes no options (got {sorted(options)})")
    if name == "no_spec":
        return StaticPolicy(0)
    if name.startswith("static_"):
        try:
            steps = int(name.removeprefix("static_"))
        except ValueError:
            raise ValueError(f"policy {name!r}: expected static_<depth>, e.g. static_3") from None
        if not 0 <= steps <= max_depth:
            raise ValueError(f"policy {name!r}: depth must lie in 0..{max_depth}")
        return StaticPolicy(steps)
    if name == "table":
        return StaticTablePolicy(max_depth=max_depth)
    if name == "sglang_adaptive":
        # The project's H200 servers: --cuda-graph-max-bs 64 (scripts/h200/offswitch.py).
        return SGLangAdaptivePolicy(max_depth=max_depth, initial_steps=max_depth,
                                    cuda_graph_bs=sglang_cuda_graph_bs(64))
    if name == "goodput_online":
        return GoodputOnlinePolicy(max_depth)
    if name in ("goodput_greedy", "goodput_explore", "oracle") and profile is None:
        raise ValueError(f"policy {name!r} needs a cost profile")
    if name == "goodput_greedy":
        return GoodputGreedyPolicy(profile, max_depth, sim_config)
    if name == "goodput_explore":
        try:
            return GoodputExplorePolicy(profile, max_depth, sim_config, **(options or {}))
        except TypeError as error:
            raise ValueError(f"policy {name!r}: bad options {options}: {error}") from None
    if name == "oracle":
        return OraclePolicy(profile, max_depth)
    if name == "ppo":
        from controller.default_policy import default_policy_path
        from controller.policy_file import ExportedPolicy

        return ExportedPolicyAdapter(ExportedPolicy.load(policy_path or default_policy_path()),
                                     probe=probe, guard=guard, candidates=candidates)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
