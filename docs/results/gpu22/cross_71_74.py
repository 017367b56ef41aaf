"""Runs 71, 73 and 74 (the MoE at 2.5, 6 requests/s): each serving's telemetry replayed open
loop through each file served there (the shipped ``ppo``, the file before, ``old``, and the
shipped file with the off ceiling 0.1, ``ceil``), so the feature specs price the same
steps; and the off price at batch >= 24 over each serving's first, middle and last third
(what the file saw as it went).

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22 \\
        python docs/results/gpu22/cross_71_74.py > docs/results/gpu22/cross_71_74.txt
"""

from __future__ import annotations

import json

import numpy as np
import replay_decisions as rd
from band_prices import band_summary
from servings import OFFSWITCH, cut_servings
from servings_70_74 import FILES, RUNS

from controller.policy_file import ExportedPolicy
from env.sim.cost_model import load_profile


def thirds(rows: list[dict]) -> list[list[float]]:
    """Median priced off / depth-3 ms at batch >= 24 in each third of the serving."""
    high = [r for r in rows if r["batch"] >= 24]
    out = []
    for part in np.array_split(np.arange(len(high)), 3):
        sel = [high[i] for i in part]
        out.append([round(float(np.median([r[k] for r in sel])), 2) if sel else None
                    for k in ("pred0_ms", "pred3_ms")])
    return out


def main() -> None:
    policies = {label: ExportedPolicy.load(path) for label, path in FILES.items()}
    for run in (71, 73, 74):
        model, profile, tag, names = RUNS[run]
        prior = load_profile(profile)
        for name, steps in cut_servings(OFFSWITCH / f"{model}_trace_{tag}_run{run}.tar.gz",
                                        OFFSWITCH / f"{model}_controller_run{run}.log", names):
            if name.startswith("ramp"):
                continue
            for label, policy in policies.items():
                rows = rd.replay(steps, policy, prior)
                print(json.dumps({"run": run, "serving": name, "through": label,
                                  "8-23": band_summary(rows, 8, 24),
                                  ">=24": band_summary(rows, 24, 10**9),
                                  "thirds_>=24_off_d3_ms": thirds(rows)}))


if __name__ == "__main__":
    main()
