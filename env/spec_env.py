"""``specctl/SpecDecode-v0``: choose the speculation depth of every decode step.

The environment replays a workload through the simulated SGLang server
(:mod:`env.sim.simulator`) one decode step at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from env.features import FeatureSpec
from env.rollout import DecisionLoop
from env.scenarios import Scenario, ScenarioSampler
from env.sim.simulator import Simulator


def env_feature_spec(cfg: Mapping[str, Any]) -> FeatureSpec:
    """The observation an environment config trains on: ``max_depth``'s default features,
    with the optional ``features`` section's settings (e.g. ``{latency_model: 2}``; the
    policy file exported from the run carries them)."""
    overrides = dict(cfg.get("features") or {})
    try:
        return FeatureSpec(max_depth=int(cfg["max_depth"]), **overrides)
    except TypeError as exc:  # an unknown field
        raise ValueError(f"env.features: {exc}") from None


#: A small, fast default: one profile, two workloads, light to overloaded.
DEFAULT_CONFIG: dict[str, Any] = {
    "max_depth": 7,
    "horizon_s": 10.0,
    "feedback_lag": 3,
    "held_out_fraction": 0.2,
    "profiles": ["h200_llama31_8b"],
    "acceptance": None,
    "workloads": [
        {"name": "azure_conv", "kind": "open", "load": [0.2, 0.6, 1.0, 1.5],
         "modulate_depth": [0.0, 0.8]},
        {"name": "fixed", "kind": "closed", "concurrency": [1, 8, 64, 256]},
    ],
    "sim": {},
    "slo_tpot_ms": None,
    "slo_penalty": 1.0,
    "reward_time_scale_s": 0.1,
    "cost_prior": "profile",
    "cost_prior_modes": {"exact": 1.0},
    "cost_prior_spread": 0.5,
    "random_server_share": 0.0,
    "randomise_reentry": False,
}


class SpecDecodeEnv(gym.Env):
    """Choose speculation steps (draft depth, 0 = off) per decode step of an SGLang server.

    **Observation** (``Box(-1, 1, (13 + 5 D,), float32)``, D = ``max_depth``): the
    vector :class:`env.features.FeatureBuilder` builds from the server's
    telemetry, exactly what the online controller sees: the decided batch size,
    waiting requests, KV-cache use, load trend, share of prefill steps, the
    steps of the latest step and of the last decision, steps since the last
    switch, per-position acceptance-rate estimates and their confidence, the
    observed latency and its predicted growth per depth, the estimated goodput
    of each depth relative to no speculation, recent throughput, how many
    recent steps measured each depth's cost, and whether a cost profile was
    given and how far measurements sit from it (see ``FeatureSpec.names()``).
    Telemetry arrives with the overlap-scheduling lag: the decision for step M
    sees steps <= M - ``feedback_lag``.

    The feature module's latency model starts from the cost profile the
    scenario hands the controller (``Scenario.prior``): the true one, one off by
    up to ``cost_prior_spread`` per coefficient, another server's, or none, drawn
    with the weights ``cost_prior_modes`` (``cost_prior: none``: always none), so
    the policy learns to trust telemetry where the profile is wrong or missing.
    With ``random_server_share`` > 0 episodes also run on randomised servers
    (:mod:`env.sim.random_servers`).

    **Action** (``Discrete(D + 1)``): speculation steps for the next decode step.

    **Reward**: with ``tokens`` the output tokens committed until the next
    decision, ``dt`` the simulated time that took, and ``rho`` the throughput of
    the same episode without speculation (computed at reset by replaying it),
    ``r = (tokens - rho * dt) / (rho * tau)`` (``tau`` = ``reward_time_scale_s``).
    Over the fixed horizon ``H`` the return is ``(H / tau) * (throughput / rho - 1)``:
    an increasing affine function of the episode's throughput, so returns rank
    policies exactly as throughput does, while each step's reward says whether
    it produced tokens faster than the no-speculation rate. With
    ``slo_tpot_ms`` set, tokens of requests whose per-token latency in the step
    exceeded it count ``1 - slo_penalty`` instead of 1 (SLO goodput).

    **Starting state**: an idle server at time 0 and a scenario drawn from the
    configured sets: a cost profile; either a window of a trace (training part;
    the last ``held_out_fraction`` is kept for evaluation) replayed open-loop at
    a load relative to the server's capacity, optionally modulated so load
    rises and falls within the episode, or C closed-loop clients.

    **Episode end**: truncated when ``horizon_s`` of simulated time has passed;
    terminated if every request of the window finished before that.
    """

    metadata: ClassVar[dict] = {"render_modes": []}

    def __init__(self, config: Mapping[str, Any] | None = None, split: str = "train") -> None:
        super().__init__()
        cfg = dict(DEFAULT_CONFIG)
        cfg.update(dict(config or {}))
        self.cfg = cfg
        self.sampler = ScenarioSampler(cfg, split=split)
        self.max_depth = int(cfg["max_depth"])
        self.feature_spec = env_feature_spec(cfg)
        self.feedback_lag = int(cfg["feedback_lag"])
        self.tau = float(cfg["reward_time_scale_s"])
        slo = cfg.get("slo_tpot_ms")
        self.slo_tpot_s = None if slo is None else float(slo) / 1e3
        self.slo_penalty = float(cfg.get("slo_penalty", 1.0))
        if cfg.get("cost_prior", "profile") not in ("profile", "none", None):
            raise ValueError(f"cost_prior must be 'profile' or 'none', got {cfg['cost_prior']!r}")
        self.observation_space = spaces.Box(-1.0, 1.0, (self.feature_spec.size,), np.float32)
        self.action_space = spaces.Discrete(self.max_depth + 1)
        self.scenario: Scenario | None = None
        #: The latest observation with its named quantities (for rule-based teachers).
        self.last_observation = None
        self._loop: DecisionLoop | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Draw a scenario (or take ``options['scenario']``) and start it."""
        super().reset(seed=seed)
        scenario = (options or {}).get("scenario")
        for _ in range(100):
            if scenario is None:
                scenario = self.sampler.sample(self.np_random)
            obs = self._start(scenario)
            if obs is not None:
                self.last_observation = obs
                return obs.vector, self._info()
            scenario = None  # an empty window: draw another
        raise RuntimeError("100 scenarios in a row had nothing to decode; check the env config")

    def _start(self, scenario: Scenario):
        self.scenario = scenario
        self.reference_tok_s = reference_throughput(scenario, self.feedback_lag)
        if self.reference_tok_s <= 0:
            return None
        sim = Simulator(scenario.profile, scenario.acceptance, scenario.workload,
                        scenario.config, seed=scenario.seed)
        self._loop = DecisionLoop(sim, self.feature_spec, self.feedback_lag,
                                  horizon_s=scenario.horizon_s, slo_tpot_s=self.slo_tpot_s,
                                  cost_prior=scenario.prior)
        obs = self._loop.reset(scenario.seed)
        # Prefill before the first decision is no action's doing, but it is part of the
        # episode's throughput: credit it to the first step so the return is exact.
        self._carry = self._reward(self._loop.tokens, self._loop.elapsed_s)
        return obs

    def _reward(self, tokens: float, elapsed_s: float) -> float:
        rho = self.reference_tok_s
        return (tokens - rho * elapsed_s) / (rho * self.tau)

    def step(self, action):
        loop = self._loop
        obs, outcome = loop.step(int(action))
        self.last_observation = obs
        tokens = outcome.tokens - self.slo_penalty * outcome.slo_violating_tokens
        reward = self._reward(tokens, outcome.elapsed_s) + self._carry
        self._carry = 0.0
        done = outcome.truncated or outcome.terminated
        vector = obs.vector if obs is not None else np.zeros(self.feature_spec.size, np.float32)
        info = self._info()
        info["step_latency_s"] = outcome.record.step_latency_s
        return vector, float(reward), outcome.terminated, outcome.truncated and done, info

    @property
    def simulator(self) -> Simulator:
        """The running episode's simulator (for hindsight teachers and diagnostics)."""
        return self._loop.sim

    def _info(self) -> dict:
        loop = self._loop
        return {
            "scenario": self.scenario.label,
            "throughput_tok_s": loop.throughput_tok_s,
            "reference_tok_s": self.reference_tok_s,
            "elapsed_s": loop.elapsed_s,
        }


def reference_throughput(scenario: Scenario, feedback_lag: int = 3) -> float:
    """Throughput of the scenario without speculation (the reward's baseline rate)."""
    sim = Simulator(scenario.profile, scenario.acceptance, scenario.workload, scenario.config,
                    seed=scenario.seed)
    loop = DecisionLoop(sim, feedback_lag=feedback_lag, horizon_s=scenario.horizon_s)
    return loop.run_static(0)
