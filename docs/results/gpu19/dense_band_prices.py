"""Runs 57, 58 and 60 (the dense model at acceptance 3.0): what the shipped file's features
priced at batch 8-23 and >= 24 per ``ppo`` serving, replayed open loop through the
daemon's decision code (``band_prices.band_summary``, swap16's ``replay_decisions``) with
the profile that served it (``h200_llama31_8b_recorded``).

Why: at 12 req/s the same file served 10.70, 12.94 and 11.54 ms mean TPOT on three
servers (no speculation 10.37), off on 78%, 52% and 87% of the decode steps at batch >= 24.

    PYTHONPATH=$PWD:docs/results/swap16:docs/results/drop_warmup:docs/results/gpu18 \\
        python docs/results/gpu19/dense_band_prices.py > docs/results/gpu19/dense_band_prices.txt
"""

from __future__ import annotations

import json

import replay_decisions as rd
from band_prices import band_summary
from dense_servings import RUNS, servings

from controller.policy_file import ExportedPolicy
from env.sim.cost_model import load_profile

PROFILE = "h200_llama31_8b_recorded"


def ppo_servings():
    """``(run, serving name, its records)`` for each ``ppo`` serving of ``RUNS``."""
    for run in RUNS:
        for name, records in servings(run):
            if name.startswith("ppo"):
                yield run, name, records


def main() -> None:
    policy, prior = ExportedPolicy.load(rd.SHIPPED), load_profile(PROFILE)
    for run, name, records in ppo_servings():
        rows = rd.replay(records, policy, prior)
        print(json.dumps({"run": run, "serving": name,
                          "<8": band_summary(rows, 0, 8),
                          "8-23": band_summary(rows, 8, 24),
                          ">=24": band_summary(rows, 24, 10**9)}))

if __name__ == "__main__":
    main()
