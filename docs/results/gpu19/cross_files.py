"""Runs 57, 58 and 60: each ``ppo`` serving's telemetry replayed open loop through three
files' decision code (the shipped file, ``c585`` = ``drop_warmup/policy_58513820.npz`` and
``c1ec`` = ``gpu18/policy_c1ec8046.npz``, both pricing off without the re-entry
warm-ups), per band: (replayed off share, predicted off / depth-3 ms, measured off /
depth-3 ms, priced depth-3 / off goodput). Open loop: what each file would have chosen on
the same steps, not what its own serving would have become.

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu19 \\
        python docs/results/gpu19/cross_files.py > docs/results/gpu19/cross_files.txt
"""

from __future__ import annotations

from pathlib import Path

import replay_decisions as rd
from band_prices import band_summary
from dense_band_prices import PROFILE, ppo_servings

from controller.policy_file import ExportedPolicy
from env.sim.cost_model import load_profile

RESULTS = Path(__file__).resolve().parents[1]
FILES = {"shipped": rd.SHIPPED, "c585": RESULTS / "drop_warmup/policy_58513820.npz",
         "c1ec": RESULTS / "gpu18/policy_c1ec8046.npz"}


def main() -> None:
    prior = load_profile(PROFILE)
    for run, name, records in ppo_servings():
        for label, path in FILES.items():
            rows = rd.replay(records, ExportedPolicy.load(path), prior)
            bands = {band: band_summary(rows, lo, hi)
                     for band, lo, hi in (("8-23", 8, 24), (">=24", 24, 10**9))}
            print(run, name, label, {band: (b["replayed_off"], b["pred_ms_off_d3"],
                                            b["meas_ms_off_d3"], b["priced_d3_over_off"])
                                     for band, b in bands.items()})


if __name__ == "__main__":
    main()
