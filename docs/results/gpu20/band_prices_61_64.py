"""Runs 61, 63 and 64: each policy serving's telemetry replayed open loop through the file
that served it (``ppo`` = the shipped 3dd256a8, kept as ``off_probe/policy_3dd256a8.npz``;
``c1ec_w1`` = ``gpu20/policy_e1ff08ab.npz``), per batch band: replayed against recorded
off share (does the replay reproduce the serving?), the features' predicted off / depth-3
ms against the measured medians, the priced depth-3 / off goodput, and why the guard let
a speculative raw choice stand (``band_prices.band_summary``).

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu19:$R/gpu20 \\
        python docs/results/gpu20/band_prices_61_64.py > docs/results/gpu20/band_prices_61_64.txt
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
FILES = {"ppo": RESULTS / "off_probe/policy_3dd256a8.npz",
         "c1ec_w1": RESULTS / "gpu20/policy_e1ff08ab.npz"}


def main() -> None:
    prior = load_profile(PROFILE)
    policies = {label: ExportedPolicy.load(path) for label, path in FILES.items()}
    for run, name, records in replayed_servings():
        label = name.split()[0]
        if label not in policies:
            continue
        rows = rd.replay(records, policies[label], prior)
        print(json.dumps({"run": run, "serving": name,
                          **{band: band_summary(rows, lo, hi) for band, lo, hi in
                             (("<8", 0, 8), ("8-23", 8, 24), (">=24", 24, 10**9))}}))


if __name__ == "__main__":
    main()
