"""Runs 61-74 (every serving ``lockin_eval.py`` cuts, and run 74's four): each serving's
telemetry replayed open loop (``replay_decisions.replay``) through the shipped file
(5c3d9060), the shipped file with the retrain's warm-up fields (``drop_warmup_latency``,
``warmup_restarts_draft``, ``warmup_flag``: the same weights, probe and guard) and the
retrain ``policy_abbd0f23.npz`` (RETRAIN.md), at batch 8-23 and >= 24 (``band_summary``).
One JSON line per serving and file; ``retrain_replay_table.py`` tabulates them.

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22 \\
        python docs/results/gpu22/retrain_replay.py > docs/results/gpu22/retrain_replay.txt
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import replay_decisions as rd
from band_prices import band_summary
from lockin_eval import RUNS as LOCKIN_RUNS
from servings import OFFSWITCH, cut_servings
from servings_70_74 import FILES
from servings_70_74 import RUNS as RUNS_70_74

from controller.policy_file import ExportedPolicy
from env.sim.cost_model import load_profile

HERE = Path(__file__).resolve().parent
RUNS = {**LOCKIN_RUNS, 74: RUNS_70_74[74]}
WARMUP_FIELDS = {"drop_warmup_latency": True, "warmup_restarts_draft": True, "warmup_flag": True}


def main() -> None:
    shipped = ExportedPolicy.load(FILES["ppo"])
    policies = {
        "shipped": shipped,
        "shipped_warmup": dataclasses.replace(
            shipped, feature_spec=dataclasses.replace(shipped.feature_spec, **WARMUP_FIELDS)),
        "rt22": ExportedPolicy.load(HERE / "policy_abbd0f23.npz"),
    }
    for run, (model, profile, tag, names) in RUNS.items():
        prior = load_profile(profile)
        for name, steps in cut_servings(OFFSWITCH / f"{model}_trace_{tag}_run{run}.tar.gz",
                                        OFFSWITCH / f"{model}_controller_run{run}.log", names):
            if name.startswith(("ramp", "probe")):
                continue
            for label, policy in policies.items():
                rows = rd.replay(steps, policy, prior)
                print(json.dumps({"run": run, "model": "MoE" if "moe" in model else "dense",
                                  "serving": name, "through": label,
                                  "8-23": band_summary(rows, 8, 24),
                                  ">=24": band_summary(rows, 24, 10**9)}), flush=True)


if __name__ == "__main__":
    main()
