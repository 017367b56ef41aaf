"""The gymnasium environment: API conformance, determinism, a reward ranking like throughput."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import env  # noqa: F401 - registers specctl/SpecDecode-v0
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


def test_passes_gymnasium_and_sb3_checkers():
    check_env(SpecDecodeEnv(SMALL), skip_render_check=True)
    sb3_check_env(SpecDecodeEnv(SMALL), warn=True)


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
        assert (scenario.workload.prompt_tokens < 102_814).all()
        labels.append(scenario.label)
    assert any("too long for this server" in label for label in labels)
