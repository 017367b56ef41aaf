"""Each ``specctl-eval`` seed's re-entry costs per no-profile window (the scenario's
``stale_accept_loss`` and ``cold_recovery_accept_fraction``, drawn per seed by
``randomise_reentry``) beside the PPO file's oracle fraction and off share in that window
of a results folder per seed.

    PYTHONPATH=$PWD python docs/results/nopro24/reentry_draws.py "/tmp/e24/rise_s{seed}" \\
        [FAMILY ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from agents.evaluate import _eval_env, _scenarios

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
SEEDS = range(8)


def main(args: list[str]) -> None:
    """Print one markdown row per no-profile window of the families asked for."""
    pattern, families = args[0], set(args[1:]) or {"h100_llama31_8b"}
    print("| seed | window | stale_accept_loss | cold_recovery_accept_fraction "
          "| ppo oracle fraction | ppo off share | oracle off share |")
    print("|---|---|---|---|---|---|---|")
    for seed in SEEDS:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
            cfg = compose(config_name="eval", overrides=[f"seed={seed}"])
        env, ev = _eval_env(cfg), cfg.eval
        scenarios = _scenarios(json.dumps(env, sort_keys=True), int(ev.windows), seed,
                               tuple(ev.get("prior_modes")), int(ev.get("random_servers") or 0))
        runs = {d["scenario"]: d["runs"] for d in json.loads(
            Path(pattern.format(seed=seed), "results.json").read_text())["scenarios"]}
        for s in scenarios:
            if s.prior_mode != "none" or s.family not in families or s.label not in runs:
                continue
            ppo, oracle = runs[s.label]["ppo"], runs[s.label]["oracle"]
            print(f"| {seed} | {s.label} | {s.config.stale_accept_loss:.2f} "
                  f"| {s.config.cold_recovery_accept_fraction:.2f} "
                  f"| {ppo['oracle_fraction']:.3f} | {ppo['off_share']:.2f} "
                  f"| {oracle['off_share']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
