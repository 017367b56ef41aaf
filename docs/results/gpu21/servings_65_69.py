"""Runs 65, 67, 68 (the dense model at acceptance 3.0, profile h200_llama31_8b_recorded)
and 69 (the MoE at 2.5, profile h200_qwen3_30b_a3b): per serving, the mean TPOT and TTFT,
the decode steps' depth shares per batch band, re-entry warm-ups per 1,000 decode steps,
the measured step latency per depth at batch >= 24 (``servings.serving_rows``); and, for
the two files' servings, the telemetry replayed open loop through the file that served it
(``band_prices.band_summary`` at batch >= 24: replayed against recorded off share, the
features' off / depth-3 ms against the measured medians, the priced depth-3 / off goodput).

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18 \\
        python docs/results/gpu21/servings_65_69.py > docs/results/gpu21/servings_65_69.txt
"""

from __future__ import annotations

import json
from pathlib import Path

import replay_decisions as rd
from band_prices import band_summary
from servings import RAMP, headline_servings

from controller.policy_file import ExportedPolicy
from env.sim.cost_model import load_profile

RESULTS = Path(__file__).resolve().parents[1]
FILES = {"ppo": RESULTS / "off_probe/policy_3dd256a8.npz",
         "adm": RESULTS / "gpu21/policy_5c3d9060.npz"}
#: run -> (model tag, profile, trace file's rate tag, servings in order after the first reload)
RUNS = {
    65: ("dense_acc3.0", "h200_llama31_8b_recorded", "r12r8",
         [*RAMP, "adm r12", "ppo r12", "cap24 r12", "adm r8", "ppo r8", "cap24 r8"]),
    67: ("dense_acc3.0", "h200_llama31_8b_recorded", "r12r12",
         [*RAMP, "ppo r12", "adm r12", "cap24 r12", "ppo r12_2", "adm r12_2", "cap24 r12_2"]),
    68: ("dense_acc3.0", "h200_llama31_8b_recorded", "r8r12",
         [*RAMP, "static_3 r8", "adm r8", "static_3 r12", "adm r12"]),
    69: ("moe_acc2.5", "h200_qwen3_30b_a3b", "r8", [*RAMP, "adm r8", "ppo r8"]),
}


def main() -> None:
    policies = {label: ExportedPolicy.load(path) for label, path in FILES.items()}
    for run, (model, profile, tag, names) in RUNS.items():
        prior = load_profile(profile)
        for policy, steps, row in headline_servings(model, run, tag, names):
            if policy in policies:
                row["replayed_>=24"] = band_summary(rd.replay(steps, policies[policy], prior),
                                                    24, 10**9)
            print(json.dumps(row))


if __name__ == "__main__":
    main()
