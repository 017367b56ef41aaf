"""Runs 51-55 (eighteenth session): what the features priced at batch 8-23 and >= 24, per
serving, replayed open loop through the daemon's decision code (swap16's
``replay_decisions``) with the policy and profile that served it.

Why: with the MoE's own profile the warm-up-aware files (``dw`` in runs 48-49, ``c585`` =
``policy_58513820.npz`` in runs 51 and 54) went off on 60-67% of the decode steps at batch
8-23 where the shipped file went off on 7-28%, and served 1.7-3.4% slower at 6 req/s;
depth 3 measures about 1.1-1.2x off's goodput per step there
(``docs/results/drop_warmup/per_batch_costs.txt``). This prints, per band, the features'
predicted off and depth-3 latency against the measured, the priced depth-3/off goodput
ratio, and the acceptance the features estimate.

    PYTHONPATH=$PWD:docs/results/swap16:docs/results/drop_warmup \\
        python docs/results/gpu18/band_prices.py > docs/results/gpu18/band_prices.txt
"""

from __future__ import annotations

import json
import math

import numpy as np
import replay_decisions as rd
from servings import OFFSWITCH, RUNS, cut_servings

from controller.policy_file import ExportedPolicy
from env.sim.cost_model import load_profile

FILES = {"ppo": rd.SHIPPED, "c585": OFFSWITCH.parents[1] / "drop_warmup/policy_58513820.npz"}


def band_summary(rows: list[dict], lo: int, hi: int) -> dict:
    """Replayed depth shares, predicted and measured off / depth-3 ms, priced ratio."""
    sel = [r for r in rows if lo <= r["batch"] < hi]
    if not sel:
        return {}

    def measured(depth: int) -> float | None:
        vals = [r["latency_ms"] for r in sel if r["recorded"] == depth]
        return round(float(np.median(vals)), 2) if vals else None

    return {
        "steps": len(sel),
        "replayed_off": round(sum(r["replayed"] == 0 for r in sel) / len(sel), 3),
        "recorded_off": round(sum(r["recorded"] == 0 for r in sel) / len(sel), 3),
        "pred_ms_off_d3": [round(float(np.median([r[k] for r in sel])), 2)
                           for k in ("pred0_ms", "pred3_ms")],
        # measured depth 0 includes the warm-ups; the median is an off step's
        "meas_ms_off_d3": [measured(0), measured(3)],
        "priced_d3_over_off": round(math.exp(float(np.median([r["g3"] for r in sel]))), 3),
        "guard": dict(sorted({g: sum(r["guard"] == g for r in sel) for g in
                              {r["guard"] for r in sel}}.items())),
    }


def policy_servings(run: int):
    """``(serving name, its records, the profile handed)`` for each serving of ``run`` by
    a file of ``FILES`` (cut at the controller's reloads, as ``servings.py`` does)."""
    profile, names = RUNS[run]
    prior = load_profile(profile)
    for name, records in cut_servings(OFFSWITCH / f"moe_acc2.5_trace_r8r6_run{run}.tar.gz",
                                      OFFSWITCH / f"moe_acc2.5_controller_run{run}.log", names):
        if name.split()[0] in FILES:
            yield name, records, prior


def main() -> None:
    for run, (profile, _) in RUNS.items():
        if run < 51:
            continue
        for name, records, prior in policy_servings(run):
            rows = rd.replay(records, ExportedPolicy.load(FILES[name.split()[0]]), prior)
            print(json.dumps({"run": run, "profile": profile, "serving": name,
                              "8-23": band_summary(rows, 8, 24),
                              ">=24": band_summary(rows, 24, 10**9)}))


def cross() -> None:
    """Each own-profile serving's telemetry through both files: the same steps, two
    feature specs, so the priced ratios compare like for like."""
    for run in (51, 54):
        for name, records, prior in policy_servings(run):
            for file_name, path in FILES.items():
                rows = rd.replay(records, ExportedPolicy.load(path), prior)
                print(json.dumps({"run": run, "serving": name, "replayed_with": file_name,
                                  "8-23": band_summary(rows, 8, 24)}))


if __name__ == "__main__":
    import sys
    cross() if sys.argv[1:] == ["--cross"] else main()
