"""The gymnasium environment: API conformance, determinism, a reward ranking like throughput."""

from __future__ import annotations

import itertools

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import env  # noqa: F401 - registers specctl/SpecDecode-v0
from env.features import FeatureSpec
from env.spec_env import SpecDecodeEnv

SMALL = {
    "horizon_s": 3.0,
    "profiles": ["h200_llama31_8b", "blackwell_tp8"],
    "workloads": [
        {"name": "azure_conv", "kind": "open", "load": [0.5, 1.5], "modulate_depth": [0.0, 0.8]},
        {"name": "fixed", "kind": "closed", "concurrency": [1, 32]},
    ],
}


def _episode(environment: SpecDecodeEnv, actions, seed: int):
    obs, info = environment.reset(seed=seed)
    observations, rewards = [obs], []
    done, i = False, 0
    while not done:
        obs, reward, terminated, truncated, info = environment.step(actions(i))
        observations.append(obs)
        rewards.append(reward)
        done = terminated or truncated
        i += 1
    return np.array(observations), np.array(rewards), info


@pytest.mark.parametrize("depth", [7, 3])
def test_passes_gymnasium_and_sb3_checkers_with_the_documented_spaces(depth):
    """The checkers test the API; the spaces are the ones the class docstring documents
    (``Box(-1, 1, (13 + 5 D,), float32)``, ``Discrete(D + 1)``), and every observation of
    an episode that tries every action lies in the box."""
    cfg = {**SMALL, "max_depth": depth}
    check_env(SpecDecodeEnv(cfg), skip_render_check=True)
    sb3_check_env(SpecDecodeEnv(cfg), warn=True)
    environment = SpecDecodeEnv(cfg)
    assert environment.observation_space == gymnasium.spaces.Box(
        -1.0, 1.0, (13 + 5 * depth,), np.float32)
    assert environment.action_space == gymnasium.spaces.Discrete(depth + 1)
    observations, _, _ = _episode(environment, lambda i: i % (depth + 1), seed=0)
    assert len(observations) > depth + 1  # every action was taken at least once
    assert all(environment.observation_space.contains(o) for o in observations)


def test_registered_id_makes_the_environment():
    made = gymnasium.make("specctl/SpecDecode-v0", config=SMALL)
    obs, _ = made.reset(seed=0)
    assert made.observation_space.contains(obs)
    assert made.action_space.n == 8


def test_seeded_runs_are_reproducible():
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 8, size=100_000)
    a = _episode(SpecDecodeEnv(SMALL), lambda i: actions[i], seed=7)
    b = _episode(SpecDecodeEnv(SMALL), lambda i: actions[i], seed=7)
    c = _episode(SpecDecodeEnv(SMALL), lambda i: actions[i], seed=8)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert a[2] == b[2]
    assert not (len(a[1]) == len(c[1]) and np.array_equal(a[1], c[1]))


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_episode_return_ranks_policies_exactly_as_their_throughput(seed):
    environment = SpecDecodeEnv(SMALL)
    returns, throughputs = {}, {}
    policies = {
        "no_spec": lambda i: 0,
        "static_1": lambda i: 1,
        "static_3": lambda i: 3,
        "static_7": lambda i: 7,
        "alternate": lambda i: 7 * (i % 2),
    }
    for name, policy in policies.items():
        _, rewards, info = _episode(environment, policy, seed=seed)
        returns[name] = rewards.sum()
        throughputs[name] = info["throughput_tok_s"]
        # The return is an affine function of throughput with a positive slope, exactly.
        horizon = environment.scenario.horizon_s
        expected = (horizon / environment.tau) * (throughputs[name] / info["reference_tok_s"] - 1)
        assert returns[name] == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert sorted(returns, key=returns.get) == sorted(throughputs, key=throughputs.get)
    assert returns["no_spec"] == pytest.approx(0.0, abs=1e-9)


def test_slo_penalty_lowers_the_return_of_slow_tokens():
    cfg = {**SMALL, "workloads": [{"name": "fixed", "kind": "closed", "concurrency": [32]}]}
    plain = _episode(SpecDecodeEnv(cfg), lambda i: 7, seed=3)[1].sum()
    strict = _episode(SpecDecodeEnv({**cfg, "slo_tpot_ms": 1.0}), lambda i: 7, seed=3)[1].sum()
    assert strict < plain


def test_held_out_split_uses_the_end_of_the_trace():
    train = SpecDecodeEnv(SMALL, split="train").sampler
    held = SpecDecodeEnv(SMALL, split="eval").sampler
    spec = SMALL["workloads"][0]
    trace = train._trace(spec)
    assert train._split_range(trace)[1] == pytest.approx(held._split_range(trace)[0])
    assert held._split_range(trace)[1] == pytest.approx(trace.duration_s)


def test_requests_too_long_for_the_server_are_left_out_and_counted():
    from env.scenarios import ScenarioSampler
    from env.sim.simulator import Simulator

    spec = {"name": "mooncake", "kind": "open", "load": [1.0]}
    cfg = {**SMALL, "horizon_s": 30.0, "profiles": ["blackwell_tp8"], "workloads": [spec]}
    sampler = ScenarioSampler(cfg, split="train")  # the Blackwell KV cache holds ~100k tokens
    labels = []
    for start in np.linspace(0.0, 1.0, 40):
        server = sampler.server("blackwell_tp8", np.random.default_rng(0))
        scenario = sampler.open_loop(spec, server, 20.0, float(start), 0.0, seed=0)
        Simulator(scenario.profile, scenario.acceptance, scenario.workload, scenario.config)
        # Every request kept fits the server's own cache with its output and a full draft.
        config, workload = scenario.config, scenario.workload
        assert config.kv_capacity_tokens == scenario.profile.server.kv_capacity_tokens
        need = (workload.prompt_tokens.astype(np.int64) + workload.output_tokens
                + config.max_depth + 1)
        assert (need <= config.kv_capacity_tokens).all()
        labels.append(scenario.label)
    assert any("too long for this server" in label for label in labels)


CLOSED = {**SMALL, "workloads": [{"name": "fixed", "kind": "closed", "concurrency": [16]}]}


@pytest.mark.parametrize("penalty", [0.0, 0.5, 1.0, 2.0])
def test_each_reward_is_tokens_over_the_reference_rate_with_slow_tokens_discounted(penalty):
    """r = (tokens - penalty * slow tokens - rho * dt) / (rho * tau), step by step; the
    prefill before the first decision is credited to the first step."""
    environment = SpecDecodeEnv({**CLOSED, "slo_tpot_ms": 4.0, "slo_penalty": penalty,
                                 "reward_time_scale_s": 0.05})
    environment.reset(seed=5)
    loop = environment._loop
    rho, tau = environment.reference_tok_s, 0.05
    assert environment.tau == tau and rho > 0
    before = (0.0, 0.0, 0.0)  # tokens, slow tokens, time at the episode's start
    done, slow_total = False, 0.0
    while not done:
        _, reward, terminated, truncated, info = environment.step(5)
        now = (loop.tokens, loop.slo_violating_tokens, loop.elapsed_s)
        tokens, slow, dt = (a - b for a, b in zip(now, before, strict=True))
        assert reward == pytest.approx((tokens - penalty * slow - rho * dt) / (rho * tau),
                                       rel=1e-9, abs=1e-9)
        slow_total += slow
        before, done = now, terminated or truncated
    assert slow_total > 0  # the SLO mattered in this episode
    assert info["elapsed_s"] == loop.elapsed_s and info["reference_tok_s"] == rho


def test_the_episode_and_its_info():
    environment = SpecDecodeEnv({**CLOSED, "max_depth": 3})
    assert environment.action_space.n == 4
    assert environment.observation_space.shape == (13 + 5 * 3,)
    obs, info = environment.reset(seed=2)
    assert np.array_equal(obs, environment.last_observation.vector)
    assert set(info) == {"scenario", "throughput_tok_s", "reference_tok_s", "elapsed_s"}
    assert info["scenario"] == environment.scenario.label
    assert environment.simulator is environment._loop.sim
    steps = 0
    while True:
        obs, _, terminated, truncated, info = environment.step(3)
        steps += 1
        assert info["step_latency_s"] > 0
        if terminated or truncated:
            break
        assert np.array_equal(obs, environment.last_observation.vector)
    assert truncated and not terminated  # closed loop: requests never run out
    assert environment.last_observation is None and not obs.any()
    assert info["elapsed_s"] == pytest.approx(SMALL["horizon_s"])
    assert environment._loop.steps_chosen[3] == steps  # the action was the depth run


def test_an_episode_whose_requests_all_finish_is_terminated_not_truncated():
    from dataclasses import replace

    from env.traces.workloads import ClosedLoop

    environment = SpecDecodeEnv(CLOSED)
    environment.reset(seed=0)
    short = replace(environment.scenario,
                    workload=ClosedLoop(2, 32, 8, requests_per_client=1))
    environment.reset(seed=0, options={"scenario": short})
    assert environment.scenario is short
    done = False
    while not done:
        _, _, terminated, truncated, _ = environment.step(1)
        done = terminated or truncated
    assert terminated and not truncated


def test_an_unknown_cost_prior_is_refused():
    with pytest.raises(ValueError, match="cost_prior must be 'profile' or 'none', got 'exact'"):
        SpecDecodeEnv({**SMALL, "cost_prior": "exact"})
    assert SpecDecodeEnv({**SMALL, "cost_prior": None}).cfg["cost_prior"] is None


def test_the_reference_is_the_throughput_without_speculation():
    from env.spec_env import reference_throughput

    environment = SpecDecodeEnv(CLOSED)
    environment.reset(seed=1)
    rho = environment.reference_tok_s
    assert rho == reference_throughput(environment.scenario, environment.feedback_lag)
    info = _episode(environment, lambda i: 0, seed=1)[2]
    assert info["throughput_tok_s"] == pytest.approx(rho, rel=1e-12)


def test_the_reference_runs_on_the_scenarios_own_server_limits():
    """16 clients on a server that runs one request at a time serve far less than on the
    scenario's own limits: the reference must replay the scenario's server, not a default."""
    from dataclasses import replace

    from env.spec_env import reference_throughput

    environment = SpecDecodeEnv(CLOSED)
    environment.reset(seed=1)
    scenario = environment.scenario
    one_at_a_time = replace(scenario, config=replace(scenario.config, max_running_requests=1))
    assert reference_throughput(one_at_a_time) < 0.5 * reference_throughput(scenario)


def test_settings_reach_the_environment():
    environment = SpecDecodeEnv({**SMALL, "slo_tpot_ms": 4.0})
    assert environment.slo_tpot_s == pytest.approx(0.004) and environment.slo_penalty == 1.0
    assert environment.observation_space == gymnasium.spaces.Box(
        -1.0, 1.0, (environment.feature_spec.size,), np.float32)
    assert environment.scenario is None and environment.last_observation is None
    assert SpecDecodeEnv({**SMALL, "cost_prior": "none"}).cfg["cost_prior"] == "none"


def test_the_episode_runs_the_drawn_scenario():
    """Its server, seed, horizon, cost prior, lag, feature layout and SLO."""
    cfg = {**SMALL, "profiles": ["blackwell_tp8"], "max_depth": 3, "feedback_lag": 2,
           "slo_tpot_ms": 5.0, "horizon_s": 2.0,
           "workloads": [{"name": "azure_conv", "kind": "open", "load": [1.5]}]}
    environment = SpecDecodeEnv(cfg)
    environment.reset(seed=3)
    scenario, loop = environment.scenario, environment._loop
    assert loop.sim.config is scenario.config and loop.sim.seed == scenario.seed
    assert loop.horizon_s == scenario.horizon_s == 2.0 and loop.feedback_lag == 2
    assert loop.features.cost_prior is scenario.prior and loop.slo_tpot_s == 0.005
    assert loop.features.spec == environment.feature_spec == FeatureSpec(max_depth=3)
    # The reference is this scenario's own throughput without speculation.
    rho = environment.reference_tok_s
    info = _episode(environment, lambda i: 0, seed=3)[2]
    assert environment.scenario.label == scenario.label
    assert info["throughput_tok_s"] == pytest.approx(rho, rel=1e-12)


def test_a_scenario_without_throughput_is_redrawn_a_hundred_times_then_refused(monkeypatch):
    import env.spec_env as spec_env

    environment = SpecDecodeEnv(SMALL)
    rates = itertools.chain([0.0], itertools.repeat(0.5))
    monkeypatch.setattr(spec_env, "reference_throughput", lambda scenario, lag: next(rates))
    environment.reset(seed=0)  # 0 tokens/s: drawn again; 0.5 tokens/s is a scenario
    assert environment.reference_tok_s == 0.5
    calls = []
    monkeypatch.setattr(spec_env, "reference_throughput",
                        lambda scenario, lag: calls.append(scenario) or 0.0)
    with pytest.raises(RuntimeError) as info:
        environment.reset(seed=0)
    assert len(calls) == 100
    assert str(info.value) == ("100 scenarios in a row had nothing to decode; check the env "
                               "config")


def test_the_env_config_s_features_section_sets_the_observation_s_estimators():
    from env.spec_env import DEFAULT_CONFIG, env_feature_spec

    assert env_feature_spec(DEFAULT_CONFIG) == FeatureSpec()
    spec = env_feature_spec({**DEFAULT_CONFIG, "features": {"latency_model": 2}})
    assert spec == FeatureSpec(latency_model=2)
    assert SpecDecodeEnv({"features": {"latency_model": 2}}).feature_spec == spec
    with pytest.raises(ValueError, match=r"env\.features"):
        env_feature_spec({**DEFAULT_CONFIG, "features": {"colour": 1}})
