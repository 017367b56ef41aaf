"""The policy map runs the bench's rollouts: it shows the depths the rollouts choose."""

from __future__ import annotations

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from agents.bench import run_sweep
from agents.policy_map import plot_policy_map, policy_map


def settings(**overrides) -> dict:
    with initialize_config_module("configs", version_base=None):
        cfg = compose("bench", overrides=["horizon_s=2", "workers=1", "plot=false"])
    return {**OmegaConf.to_container(cfg, resolve=True), **overrides}


def test_static_policies_map_to_their_depth(tmp_path):
    for policy, depth in (("static_3", 3), ("no_spec", 0)):
        result = policy_map(settings(), policy, concurrency=(1, 16), accept_rates=(0.3, 0.9))
        assert (result.depth == depth).all() and (result.share == 1.0).all()
    plot_policy_map(result, tmp_path / "map.png")
    assert (tmp_path / "map.png").stat().st_size > 0


def test_the_map_agrees_with_the_sweep_rollouts():
    base = settings(profile="h200_llama31_8b")
    result = policy_map(base, "goodput_greedy", concurrency=(1, 64), accept_rates=(0.8,))
    sweep = run_sweep({**base, "policies": ["goodput_greedy"], "concurrency": [1, 64],
                       "acceptance": {"model": "parametric", "alphas": [0.8] * 7}})
    for j, c in enumerate((1, 64)):
        counts = sweep["results"]["goodput_greedy"][str(c)]["steps_chosen"]
        assert result.depth[0, j] == max(range(len(counts)), key=counts.__getitem__)
    assert result.depth[0, 0] > 0  # a light load at high acceptance: speculation pays
