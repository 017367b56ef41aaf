"""Open loop, no profile: runs 92 (MoE 2.5, both ``ppo`` servings), 93 (MoE 1.1), 95 and
97 (dense 3.0, 8 and 12 requests/s) replayed through the shipped file and the local26
candidate(s): per batch band (<8, 8-23, >=24) the predicted and measured off / depth-3
step (ms, medians), the priced depth-3 / off goodput and the replayed off share.

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22:$R/gpu26 \\
        python docs/results/local26/bands.py [candidate.npz ...] > docs/results/local26/bands.txt
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import replay_decisions as rd
from band_prices import band_summary
from servings import headline_servings
from servings_91_97 import PPO, RUNS

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parents[2] / "controller/data/default_policy.npz"
BANDS = (("<8", 1, 8), ("8-23", 8, 24), (">=24", 24, 10**9))


def main() -> None:
    paths = [SHIPPED, *(Path(p) for p in sys.argv[1:])]
    files = {hashlib.sha256(p.read_bytes()).hexdigest()[:8]: ExportedPolicy.load(p)
             for p in paths}
    for run, (model, tag, names) in RUNS.items():
        for policy, steps, _row in headline_servings(model, run, tag, names):
            if policy not in PPO:
                continue
            for sha, file in files.items():
                replayed = rd.replay(steps, file, None)
                out = {"run": run, "serving": f"{policy} {names[-1].split()[-1]}",
                       "file": sha, "all_off": round(
                           sum(r["replayed"] == 0 for r in replayed) / len(replayed), 3)}
                for band, lo, hi in BANDS:
                    summary = band_summary(replayed, lo, hi)
                    summary.pop("guard", None)
                    out[band] = summary
                print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
