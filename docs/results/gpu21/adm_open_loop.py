"""Runs 61, 63 and 64's servings (the twentieth session's dense model at 12 and 8 req/s)
replayed open loop through the shipped file and through ``adm`` (the shipped file with
``FeatureSpec.latency_drop_before_prefill``): per serving, the replayed off share per batch
band and, at batch >= 24, the features' off / depth-3 ms and priced depth-3 / off goodput
(``band_prices.band_summary``), with the measured medians. What ``adm`` would have chosen
on those steps, not what its own servings would have become (runs 65-68 served it).

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu19:$R/gpu20 \\
        python docs/results/gpu21/adm_open_loop.py > docs/results/gpu21/adm_open_loop.txt
"""

from __future__ import annotations

import json
from pathlib import Path

import replay_decisions as rd
from band_prices import band_summary
from dense_band_prices import PROFILE
from servings_61_64 import replayed_servings

from controller.policy_file import ExportedPolicy
from env.sim.cost_model import load_profile

RESULTS = Path(__file__).resolve().parents[1]
FILES = {"shipped": RESULTS / "off_probe/policy_3dd256a8.npz",
         "adm": RESULTS / "gpu21/policy_5c3d9060.npz"}
BANDS = (("<8", 0, 8), ("8-23", 8, 24), (">=24", 24, 10**9))


def main() -> None:
    prior = load_profile(PROFILE)
    policies = {label: ExportedPolicy.load(path) for label, path in FILES.items()}
    for run, name, records in replayed_servings():
        row: dict = {"run": run, "serving": name}
        for label, policy in policies.items():
            rows = rd.replay(records, policy, prior)
            bands = {band: band_summary(rows, lo, hi) for band, lo, hi in BANDS}
            high = bands[">=24"]
            row["measured_>=24"] = high.get("meas_ms_off_d3")
            row[label] = {"replayed_off": {band: b.get("replayed_off")
                                           for band, b in bands.items()},
                          "pred_ms_off_d3_>=24": high.get("pred_ms_off_d3"),
                          "priced_d3_over_off_>=24": high.get("priced_d3_over_off")}
        print(json.dumps(row))


if __name__ == "__main__":
    main()
